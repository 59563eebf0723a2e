//! Random inputs for the unit tests: fresh every run, never zeros.

/// A seed that differs between runs (tests print it on failure).
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// Gaussian values (Box–Muller over a xorshift stream); `outliers` scales every 7th channel by 6
/// and shifts every 5th by 1.5, like real keys.
pub fn randn(n: usize, seed: u64, outliers: bool) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut u = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|i| {
            let g = ((-2.0 * u().ln()).sqrt() * (2.0 * std::f64::consts::PI * u()).cos()) as f32;
            if outliers {
                g * if i % 7 == 3 { 6.0 } else { 1.0 } + if i % 5 == 1 { 1.5 } else { 0.0 }
            } else {
                g
            }
        })
        .collect()
}

/// A CPU tensor of fresh Gaussian values (seeded by the clock, mixed with `salt`).
pub fn rand_tensor(shape: &[usize], salt: u64) -> candle_core::Tensor {
    let n = shape.iter().product();
    let seed = fresh_seed() ^ salt.wrapping_mul(0xA24BAED4963EE407);
    candle_core::Tensor::from_vec(randn(n, seed, false), shape, &candle_core::Device::Cpu).expect("shape matches")
}
