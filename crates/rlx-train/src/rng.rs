//! A small seeded generator (splitmix64) for initial weights and data order, so a
//! training job is reproducible from its seed alone.

/// splitmix64: 64-bit state, one multiply-xorshift mix per draw.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose draws depend only on `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[-bound, bound)`.
    pub fn symmetric(&mut self, bound: f64) -> f64 {
        (self.unit() * 2.0 - 1.0) * bound
    }

    /// Uniform below `n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproducible_and_spread() {
        let (mut a, mut b) = (Rng::new(5), Rng::new(5));
        assert_eq!(a.next_u64(), b.next_u64());
        let xs: Vec<f64> = (0..20_000).map(|_| a.unit()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let ns: Vec<f64> = (0..20_000).map(|_| a.normal()).collect();
        let var = ns.iter().map(|x| x * x).sum::<f64>() / ns.len() as f64;
        assert!((var - 1.0).abs() < 0.05, "{var}");
        let mut order: Vec<usize> = (0..50).collect();
        a.shuffle(&mut order);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(order, sorted);
        assert!((0..1000).all(|_| a.below(7) < 7));
    }
}
