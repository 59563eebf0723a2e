//! The arrays `KvCache` takes: NumPy arrays on the host, or CUDA arrays of any framework that
//! publishes `__cuda_array_interface__` (PyTorch, CuPy, Numba, JAX) — read in place through their
//! device address, never through the host.

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::ShapeError;

/// A float32 array's data, C order, checked against `shape` (`None` matches any length).
pub fn host<'a>(x: &'a PyReadonlyArrayDyn<'_, f32>, shape: &[Option<usize>], what: &str) -> PyResult<&'a [f32]> {
    check_shape(x.shape(), shape, what)?;
    x.as_slice()
        .map_err(|_| ShapeError::new_err(format!("{what}: the array must be C-contiguous (np.ascontiguousarray)")))
}

fn check_shape(dims: &[usize], shape: &[Option<usize>], what: &str) -> PyResult<()> {
    if dims.len() != shape.len() || dims.iter().zip(shape).any(|(d, s)| s.is_some_and(|s| s != *d)) {
        let want: Vec<String> = shape.iter().map(|s| s.map_or("n".into(), |s| s.to_string())).collect();
        return Err(ShapeError::new_err(format!("{what}: expected shape [{}], got {dims:?}", want.join(", "))));
    }
    Ok(())
}

/// A C-contiguous float32 CUDA array described by `__cuda_array_interface__` (version 2 or 3).
#[derive(Clone, Debug)]
pub struct CudaArray {
    /// Its device address (read by the CUDA build only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub ptr: u64,
    /// Its dimensions.
    pub shape: Vec<usize>,
    /// The stream its producer last wrote it on, as a `CUstream` handle (the interface's
    /// numbering is the driver's: 1 legacy default, 2 per-thread default); `None` if it names none.
    pub stream: Option<u64>,
}

impl CudaArray {
    /// The array behind `x`'s `__cuda_array_interface__`, or `None` if `x` publishes none (a
    /// host array). `writable`: refuse read-only arrays. Checked against `shape` as
    /// [`host`] checks.
    pub fn of(x: &Bound<'_, PyAny>, shape: &[Option<usize>], what: &str, writable: bool) -> PyResult<Option<Self>> {
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
        if typestr != "<f4" {
            return Err(ShapeError::new_err(format!(
                "{what}: expected float32 (typestr \"<f4\"), got {typestr:?} (convert with .float())"
            )));
        }
        let dims: Vec<usize> = get("shape")?.extract()?;
        check_shape(&dims, shape, what)?;
        if let Some(strides) = iface.get_item("strides")?.filter(|s| !s.is_none()) {
            let strides: Vec<isize> = strides.extract()?;
            let mut want = 4isize;
            for (&s, &d) in strides.iter().zip(&dims).rev() {
                if d > 1 && s != want {
                    return Err(ShapeError::new_err(format!(
                        "{what}: the array must be C-contiguous (.contiguous()), strides {strides:?}"
                    )));
                }
                want *= d as isize;
            }
        }
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
        Ok(Some(Self { ptr, shape: dims, stream }))
    }

    /// Elements.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}
