"""The model zoo's definitions (`models.py`); `bench/zoo.py` runs them."""
