//! Small dense linear algebra for the laboratory's codec experiments (f64 where it accumulates):
//! symmetric eigen-decomposition and matrix functions of 64×64 second-moment matrices, not worth
//! a LAPACK dependency.

/// Symmetric eigen-decomposition (cyclic Jacobi), `a` row-major n×n → (values, vectors as columns).
pub fn jacobi(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut a = a.to_vec();
    let mut v = vec![0.0; n * n];
    (0..n).for_each(|i| v[i * n + i] = 1.0);
    for _sweep in 0..60 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j].powi(2))
            .sum();
        let diag: f64 = (0..n).map(|i| a[i * n + i].powi(2)).sum();
        if off <= 1e-24 * diag {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

/// V f(Λ) Vᵀ from [`jacobi`]'s output.
pub fn spectral(vals: &[f64], vecs: &[f64], n: usize, f: impl Fn(f64) -> f64) -> Vec<f32> {
    let mut m = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            m[i * n + j] = (0..n).map(|k| vecs[i * n + k] * f(vals[k]) * vecs[j * n + k]).sum::<f64>() as f32;
        }
    }
    m
}

/// `out = m x` for a row-major n×n `m`.
pub fn matvec(m: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    for i in 0..n {
        out[i] = (0..n).map(|j| m[i * n + j] * x[j]).sum();
    }
}
