//! The arrays `KvCache` takes: NumPy arrays on the host, or CUDA arrays — torch CUDA tensors, or
//! those of any framework that publishes `__cuda_array_interface__` (CuPy, Numba, JAX) — read in
//! place through their device address, never through the host.

use std::borrow::Cow;

use numpy::ndarray::IxDyn;
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use veloq_candle::interop::ForeignDType;

use crate::errors::ShapeError;

/// A float32 array's data, C order, checked against `shape` (`None` matches any length).
pub fn host<'a>(x: &'a PyReadonlyArrayDyn<'_, f32>, shape: &[Option<usize>], what: &str) -> PyResult<&'a [f32]> {
    check_shape(x.shape(), shape, what)?;
    x.as_slice()
        .map_err(|_| ShapeError::new_err(format!("{what}: the array must be C-contiguous (np.ascontiguousarray)")))
}

/// A float32 array's data in the order `[batch, tokens, heads, dim]` where `heads_first` says it
/// was given as `[batch, heads, tokens, dim]` (transformers' layout): read in place when its
/// memory is already in that order (a transposed view, as attention projections make), copied
/// into it otherwise. Without `heads_first`, as [`host`].
pub fn host_steps<'a>(
    x: &'a PyReadonlyArrayDyn<'_, f32>,
    shape: &[Option<usize>],
    what: &str,
    heads_first: bool,
) -> PyResult<Cow<'a, [f32]>> {
    if !heads_first {
        return host(x, shape, what).map(Cow::Borrowed);
    }
    check_host_steps(x, shape, what, true)?;
    let view = x.as_array().permuted_axes(IxDyn(&[0, 2, 1, 3]));
    Ok(match view.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(view.iter().copied().collect()),
    })
}

/// Checks a host array as [`host_steps`] reads it, without reading it.
pub fn check_host_steps(
    x: &PyReadonlyArrayDyn<'_, f32>,
    shape: &[Option<usize>],
    what: &str,
    heads_first: bool,
) -> PyResult<()> {
    if !heads_first {
        return host(x, shape, what).map(drop);
    }
    check_shape(&steps_dims(x.shape().to_vec(), true), shape, what)
}

/// `dims` (or strides) of an array given heads first, in `[batch, tokens, heads, dim]` order.
fn steps_dims<T>(mut dims: Vec<T>, heads_first: bool) -> Vec<T> {
    if heads_first && dims.len() == 4 {
        dims.swap(1, 2);
    }
    dims
}

fn check_shape(dims: &[usize], shape: &[Option<usize>], what: &str) -> PyResult<()> {
    if dims.len() != shape.len() || dims.iter().zip(shape).any(|(d, s)| s.is_some_and(|s| s != *d)) {
        let want: Vec<String> = shape.iter().map(|s| s.map_or("n".into(), |s| s.to_string())).collect();
        return Err(ShapeError::new_err(format!("{what}: expected shape [{}], got {dims:?}", want.join(", "))));
    }
    Ok(())
}

/// A C-contiguous float32, float16 or bfloat16 CUDA array: a torch CUDA tensor (read through its
/// own attributes, the fast path a decode step takes once per layer) or any array publishing
/// `__cuda_array_interface__` (version 2 or 3: CuPy, Numba, JAX; float32 or float16).
#[derive(Clone, Debug)]
pub struct CudaArray {
    /// Its device address (read by the CUDA build only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub ptr: u64,
    /// Its dimensions.
    pub shape: Vec<usize>,
    /// Its element type (veloq's cache converts it on the way in and out, in the copy).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub elem: ForeignDType,
    /// The CUDA device it lives on, where the array says (torch tensors do).
    pub device: Option<usize>,
    /// The stream its producer last wrote it on, as a `CUstream` handle (the interface's
    /// numbering is the driver's: 1 legacy default, 2 per-thread default); `None` if it names none.
    pub stream: Option<u64>,
}

impl CudaArray {
    /// The array behind `x` — a torch CUDA tensor or an object with `__cuda_array_interface__` —
    /// or `None` if `x` is neither (a host array). `writable`: refuse read-only arrays. Checked
    /// against `shape` as [`host`] checks, and to be C-contiguous.
    pub fn of(x: &Bound<'_, PyAny>, shape: &[Option<usize>], what: &str, writable: bool) -> PyResult<Option<Self>> {
        Self::steps(x, shape, what, writable, false)
    }

    /// As [`of`](Self::of), for an array that `heads_first` may give as `[batch, heads, tokens,
    /// dim]`: its shape is then reported, and checked against `shape`, in `[batch, tokens, heads,
    /// dim]` order, whose memory order it must have (a transposed view, as attention projections
    /// make: read in place, no copy).
    pub fn steps(
        x: &Bound<'_, PyAny>,
        shape: &[Option<usize>],
        what: &str,
        writable: bool,
        heads_first: bool,
    ) -> PyResult<Option<Self>> {
        if let Some(a) = Self::torch(x, what, heads_first)? {
            check_shape(&a.shape, shape, what)?;
            return Ok(Some(a));
        }
        let Ok(iface) = x.getattr("__cuda_array_interface__") else {
            return Ok(None);
        };
        let iface = iface
            .cast_into::<PyDict>()
            .map_err(|_| ShapeError::new_err(format!("{what}: __cuda_array_interface__ is not a dict")))?;
        let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
            iface
                .get_item(key)?
                .ok_or_else(|| ShapeError::new_err(format!("{what}: __cuda_array_interface__ has no {key:?}")))
        };
        let typestr: String = get("typestr")?.extract()?;
        let elem = match typestr.as_str() {
            "<f4" => ForeignDType::F32,
            "<f2" => ForeignDType::F16,
            _ => {
                return Err(ShapeError::new_err(format!(
                    "{what}: expected float32 or float16 (typestr \"<f4\" or \"<f2\"), got {typestr:?}"
                )))
            }
        };
        let given: Vec<usize> = get("shape")?.extract()?;
        let strides = match iface.get_item("strides")?.filter(|s| !s.is_none()) {
            Some(s) => s.extract::<Vec<isize>>()?,
            None => c_strides(&given, elem.size() as isize),
        };
        let dims = steps_dims(given, heads_first);
        check_shape(&dims, shape, what)?;
        check_contiguous(&dims, &steps_dims(strides, heads_first), elem.size() as isize, what, heads_first)?;
        let data = get("data")?;
        let data = data.cast::<PyTuple>().map_err(|_| ShapeError::new_err(format!("{what}: data is not a tuple")))?;
        let ptr: u64 = data.get_item(0)?.extract()?;
        let readonly: bool = data.get_item(1)?.extract()?;
        if writable && readonly {
            return Err(ShapeError::new_err(format!("{what}: the array is read-only")));
        }
        if ptr == 0 && dims.iter().product::<usize>() > 0 {
            return Err(ShapeError::new_err(format!("{what}: a null device address")));
        }
        let stream = match iface.get_item("stream")? {
            Some(s) if !s.is_none() => Some(s.extract()?),
            _ => None,
        };
        Ok(Some(Self { ptr, shape: dims, elem, device: None, stream }))
    }

    /// A torch CUDA tensor read through its attributes (torch's `__cuda_array_interface__` is
    /// Python code, run once per array per call, and knows no bfloat16); `None` for anything else,
    /// CPU tensors included.
    fn torch(x: &Bound<'_, PyAny>, what: &str, heads_first: bool) -> PyResult<Option<Self>> {
        let ty = x.get_type();
        if !ty.module().is_ok_and(|m| m.to_cow().is_ok_and(|m| m == "torch" || m.starts_with("torch.")))
            || !x.hasattr(pyo3::intern!(x.py(), "data_ptr"))?
        {
            return Ok(None);
        }
        let py = x.py();
        let device = x.getattr(pyo3::intern!(py, "device"))?;
        if device.getattr(pyo3::intern!(py, "type"))?.extract::<String>()? != "cuda" {
            return Ok(None);
        }
        let dtype = x.getattr(pyo3::intern!(py, "dtype"))?.str()?;
        let elem = match &*dtype.to_cow()? {
            "torch.float32" => ForeignDType::F32,
            "torch.float16" => ForeignDType::F16,
            "torch.bfloat16" => ForeignDType::Bf16,
            other => {
                return Err(ShapeError::new_err(format!(
                    "{what}: expected float32, float16 or bfloat16, got {other} (convert with .float())"
                )))
            }
        };
        let dims: Vec<usize> = steps_dims(x.getattr(pyo3::intern!(py, "shape"))?.extract()?, heads_first);
        let strides: Vec<isize> = steps_dims(x.call_method0(pyo3::intern!(py, "stride"))?.extract()?, heads_first);
        // Element strides: the check below counts in bytes.
        let size = elem.size() as isize;
        let strides: Vec<isize> = strides.iter().map(|s| s * size).collect();
        check_contiguous(&dims, &strides, size, what, heads_first)?;
        let ptr: u64 = x.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
        let index: Option<usize> = device.getattr(pyo3::intern!(py, "index"))?.extract()?;
        Ok(Some(Self { ptr, shape: dims, elem, device: index, stream: None }))
    }

    /// Elements.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Byte strides of a C-contiguous array of `dims`.
fn c_strides(dims: &[usize], size: isize) -> Vec<isize> {
    let mut strides = vec![size; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1] as isize;
    }
    strides
}

/// Byte strides of a C-contiguous array of `dims` (dimensions of length 1 may have any stride).
/// `heads_first`: `dims` and `strides` were reordered from an array given heads first.
fn check_contiguous(dims: &[usize], strides: &[isize], size: isize, what: &str, heads_first: bool) -> PyResult<()> {
    let mut want = size;
    for (&s, &d) in strides.iter().zip(dims).rev() {
        if d > 1 && s != want {
            return Err(ShapeError::new_err(if heads_first {
                format!(
                    "{what}: given heads first, the array must be a transposed view of C-contiguous \
                     [batch, tokens, heads, dim] memory (x.transpose(1, 2).contiguous().transpose(1, 2)); \
                     byte strides in that order {strides:?}"
                )
            } else {
                format!("{what}: the array must be C-contiguous (.contiguous()), byte strides {strides:?}")
            }));
        }
        want *= d as isize;
    }
    Ok(())
}
