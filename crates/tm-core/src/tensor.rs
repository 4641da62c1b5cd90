//! Tensor descriptors and device tensors.

use crate::alloc::{Allocator, Buffer};
use crate::{DType, Error, Result};
use std::sync::Arc;

/// Shape and dtype of a contiguous, row-major tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
}

impl TensorDesc {
    /// A descriptor.
    pub fn new(dtype: DType, shape: &[usize]) -> Self {
        TensorDesc { dtype, shape: shape.to_vec() }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        self.dtype.storage_bytes(self.numel())
    }
}

/// A contiguous tensor in device memory; owns its [`Buffer`].
#[derive(Debug)]
pub struct Tensor {
    desc: TensorDesc,
    buffer: Buffer,
}

impl Tensor {
    /// Allocates a zero-filled tensor from `allocator`.
    pub fn zeros(allocator: &Arc<dyn Allocator>, desc: TensorDesc, phase: &str) -> Result<Tensor> {
        let buffer = Buffer::new(allocator, desc.bytes(), phase)?;
        Ok(Tensor { desc, buffer })
    }

    /// Wraps a buffer that holds at least `desc.bytes()` bytes.
    pub fn from_buffer(buffer: Buffer, desc: TensorDesc) -> Result<Tensor> {
        if buffer.len() < desc.bytes() {
            return Err(Error::invalid(format!(
                "buffer of {} bytes cannot hold tensor {:?} ({} bytes)",
                buffer.len(),
                desc,
                desc.bytes()
            )));
        }
        Ok(Tensor { desc, buffer })
    }

    /// Descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }
    /// Dtype.
    pub fn dtype(&self) -> DType {
        self.desc.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.desc.shape
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.desc.numel()
    }
    /// The owning buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
    /// The owning buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut Buffer {
        &mut self.buffer
    }

    /// Changes the shape without touching the data; the element count may shrink (the buffer
    /// keeps its capacity) or grow up to the buffer's capacity.
    pub fn reshape(&mut self, shape: &[usize]) -> Result<()> {
        let desc = TensorDesc::new(self.desc.dtype, shape);
        if desc.bytes() > self.buffer.len() {
            return Err(Error::shape("reshape", format!("at most {} bytes", self.buffer.len()), shape));
        }
        self.desc = desc;
        Ok(())
    }

    /// Checks the shape, naming `what` in the error.
    pub fn expect_shape(&self, what: &str, shape: &[usize]) -> Result<()> {
        if self.desc.shape != shape {
            return Err(Error::shape(what, shape, &self.desc.shape));
        }
        Ok(())
    }

    /// Checks the dtype, naming `what` in the error.
    pub fn expect_dtype(&self, what: &str, dtype: DType) -> Result<()> {
        if self.desc.dtype != dtype {
            return Err(Error::DType {
                op: what.into(),
                expected: dtype.to_string(),
                got: self.desc.dtype.to_string(),
            });
        }
        Ok(())
    }

    /// Host view as `T`, when the memory is host-accessible and `T` matches the element size.
    pub fn host<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        let n = self.desc.bytes();
        let bytes =
            self.buffer.host_bytes().ok_or_else(|| Error::Unsupported("tensor is not host-accessible".into()))?;
        bytemuck::try_cast_slice(&bytes[..n]).map_err(|e| Error::invalid(format!("host view of {:?}: {e}", self.desc)))
    }

    /// Mutable host view as `T`.
    pub fn host_mut<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        let n = self.desc.bytes();
        let desc = self.desc.clone();
        let bytes =
            self.buffer.host_bytes_mut().ok_or_else(|| Error::Unsupported("tensor is not host-accessible".into()))?;
        bytemuck::try_cast_slice_mut(&mut bytes[..n]).map_err(|e| Error::invalid(format!("host view of {desc:?}: {e}")))
    }
}
