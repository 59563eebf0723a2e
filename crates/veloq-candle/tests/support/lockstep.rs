//! A cache under test run in lockstep with its [`ShadowCache`]: both take the same keys and
//! values (the model's, computed from the cache under test's own outputs), so they hold the same
//! f16 rows and — the codes being one function of those rows — the same codes; every `attend`
//! is checked against the reference's f64 attention and the cache under test's output goes on.
//! Divergence cannot build up over layers and steps, so the check is exact to f32 rounding on any
//! machine and with any calibration, however good the codec.

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use veloq_candle::cache::{LayerCache, Step};
use veloq_candle::Result;

use super::shadow_cache::ShadowCache;

/// The worst relative error (‖got − want‖ / ‖want‖ over a step's outputs) seen by every layer.
#[derive(Clone, Default)]
pub struct Worst(Arc<Mutex<f64>>);

impl Worst {
    pub fn get(&self) -> f64 {
        *self.0.lock().unwrap()
    }
}

/// One layer: the cache under test beside its reference.
pub struct Lockstep {
    real: Box<dyn LayerCache>,
    shadow: ShadowCache,
    worst: Worst,
}

impl Lockstep {
    pub fn new(real: Box<dyn LayerCache>, shadow: ShadowCache, worst: Worst) -> Self {
        Self { real, shadow, worst }
    }
}

impl LayerCache for Lockstep {
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()> {
        self.real.append(k, v, step)?;
        self.shadow.append(k, v, step)
    }

    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor> {
        let got = self.real.attend(q, step, scale)?;
        let want = self.shadow.attend(q, step, scale)?;
        let flat =
            |t: &Tensor| -> Vec<f32> { t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
        let (g, w) = (flat(&got), flat(&want));
        let (e, n) = g
            .iter()
            .zip(&w)
            .fold((0.0f64, 0.0f64), |(e, n), (&a, &b)| (e + (a as f64 - b as f64).powi(2), n + (b as f64).powi(2)));
        assert!(g.iter().all(|x| x.is_finite()), "non-finite attention output");
        let mut worst = self.worst.0.lock().unwrap();
        *worst = worst.max((e / n).sqrt());
        Ok(got)
    }

    fn commit(&mut self) -> Result<()> {
        self.real.commit()?;
        self.shadow.commit()
    }

    fn slots(&self) -> usize {
        self.real.slots()
    }

    fn len(&self, slot: usize) -> usize {
        let n = self.real.len(slot);
        assert_eq!(n, self.shadow.len(slot), "cache and reference hold different lengths");
        n
    }

    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.real.truncate(slot, len)?;
        self.shadow.truncate(slot, len)
    }

    fn resident_bytes(&self) -> usize {
        self.real.resident_bytes()
    }

    fn sequence_bytes(&self, positions: usize) -> usize {
        self.real.sequence_bytes(positions)
    }
}
