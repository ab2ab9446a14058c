//! The digits job end to end: scikit-learn's digits fetched from its wheel, an MLP
//! and a CNN trained with the job's defaults, each at least 97% right on the held-out
//! images.

use rlx_models::ModelStore;
use rlx_train::jobs::{Digits, DigitsConfig, DigitsModel, TEST_IMAGES, train_digits};

#[test]
fn mlp_and_cnn_reach_97_percent_on_the_test_images() {
    let store = ModelStore::from_env().expect("cache directory").quiet(true);
    let data = Digits::fetch(&store).expect("the digits");
    assert_eq!(data.test_y.len(), TEST_IMAGES);
    assert_eq!(data.train_y.len() + TEST_IMAGES, 1797);
    assert_eq!(data.train_x.len(), data.train_y.len() * 64);
    // Every class is in both sets.
    for class in 0..10 {
        assert!(data.test_y.contains(&class) && data.train_y.contains(&class));
    }
    for model in [DigitsModel::Mlp, DigitsModel::Cnn] {
        let config = DigitsConfig {
            model,
            ..DigitsConfig::default()
        };
        let (trainer, report) = train_digits(&data, &config, &mut |_| {}).expect("training");
        let accuracy = report.metric("test_accuracy").expect("the accuracy");
        let first = report.losses[..10].iter().sum::<f32>() / 10.0;
        let last = report.losses[report.losses.len() - 10..]
            .iter()
            .sum::<f32>()
            / 10.0;
        eprintln!("{model:?}: test accuracy {accuracy:.4}, loss {first:.3} -> {last:.3}");
        assert!(accuracy >= 0.97, "{model:?}: test accuracy {accuracy}");
        assert!(
            last < first / 10.0,
            "{model:?}: the loss fell from {first} to {last} only"
        );
        assert_eq!(trainer.steps() as usize, report.losses.len());
    }
}

#[test]
fn a_malformed_csv_is_an_error_naming_its_line() {
    let dir = std::env::temp_dir().join(format!("rlx-digits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let row = |label: &str| {
        let mut fields = vec!["3"; 64];
        fields.push(label);
        fields.join(",")
    };
    let cases = [
        (format!("{}\n{}\n", row("1"), row("12")), "line 2: label 12"),
        (format!("{}\n1,2,3\n", row("1")), "line 2: 3 fields"),
        (format!("{}\n", row("x")), "line 1"),
        (
            format!("{}\n", row("1").replacen('3', "17", 1)),
            "outside 0-16",
        ),
        (format!("{}\n", row("1")), "only 1 images"),
    ];
    for (text, expected) in cases {
        let path = dir.join("digits.csv");
        std::fs::write(&path, text).unwrap();
        let err = Digits::from_csv(&path).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    assert!(Digits::from_csv(&dir.join("absent.csv")).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn inconsistent_sets_are_an_error() {
    let data = Digits {
        train_x: vec![0.0; 64 * 40 - 1],
        train_y: vec![0; 40],
        test_x: vec![0.0; 64],
        test_y: vec![0],
    };
    let err = train_digits(&data, &DigitsConfig::default(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("64 pixels"), "{err}");
}
