//! The forward pass's weight matrices: candle's quantized matmul, except for Q4_1 weights on the
//! CPU, which go to veloq's kernel (`veloq::kernels::cpu::q4_1`: candle has no SIMD path for
//! Q4_1, and SmolLM2's common GGUF is Q4_1).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};

use crate::error::Result;

pub(crate) enum Linear {
    Candle(QMatMul),
    /// `rows × cols` weights as Q4_1 blocks, row after row.
    Q41 {
        blocks: Vec<u8>,
        rows: usize,
        cols: usize,
    },
}

impl Linear {
    /// A GGUF weight `[rows, cols]`; `CANDLE_DEQUANTIZE_ALL` still means f32 weights everywhere.
    pub(crate) fn new(q: QTensor) -> Result<Self> {
        let q = Arc::new(q);
        let mm = QMatMul::from_arc(q.clone())?;
        let own = matches!(mm, QMatMul::QTensor(_))
            && q.device().is_cpu()
            && q.dtype() == GgmlDType::Q4_1
            && q.shape().rank() == 2
            && q.shape().dims()[1].is_multiple_of(veloq::kernels::cpu::q4_1::BLOCK);
        if !own {
            return Ok(Linear::Candle(mm));
        }
        let (rows, cols) = q.shape().dims2()?;
        drop(mm);
        Ok(Linear::Q41 { blocks: q.data()?.into_owned(), rows, cols })
    }
}

impl From<QMatMul> for Linear {
    fn from(q: QMatMul) -> Self {
        Linear::Candle(q)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::Candle(q) => q.forward(x),
            Linear::Q41 { blocks, rows, cols } => {
                let mut dims = x.dims().to_vec();
                let k = dims.pop().unwrap_or(0);
                if k != *cols {
                    candle_core::bail!("Q4_1 weights [{rows}, {cols}] applied to activations {:?}", x.shape());
                }
                let n = x.elem_count() / k.max(1);
                let xs = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; n * rows];
                veloq::kernels::cpu::q4_1::matmul(&xs, n, k, blocks, *rows, &mut out)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                dims.push(*rows);
                Tensor::from_vec(out, dims, x.device())
            }
        }
    }
}
