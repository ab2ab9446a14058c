//! The CPU's implementation of the backend seam over [`CpuProgram`].

use crate::{CpuProgram, SharedCpuParam};
use rlx_backend::{Backend, BackendOptions, Executable, HandleStorage, SharedParam};
use rlx_driver::{Buffer, Device, Profile};
use rlx_ir::{Error, NodeId, Result};
use rlx_opt::{FusionOptions, Plan};
use std::sync::Arc;

/// Runs plans on the host CPU.
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn fusion(&self) -> FusionOptions {
        FusionOptions::ALL
    }

    fn compile(&self, plan: Arc<Plan>, options: &BackendOptions) -> Result<Box<dyn Executable>> {
        Ok(Box::new(CpuProgram::with_bf16_products(
            plan,
            options.threads,
            options.allow_bf16,
        )?))
    }
}

impl Executable for CpuProgram {
    fn kernels(&self) -> Vec<(NodeId, String)> {
        CpuProgram::kernels(self)
    }

    fn set_param(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        CpuProgram::set_param(self, index, bytes)
    }

    fn export_param(&self, index: usize) -> Result<SharedParam> {
        Ok(SharedParam::new(Device::Cpu, self.shared_param(index)?))
    }

    fn import_param(&mut self, index: usize, param: &SharedParam) -> Result<()> {
        let buffer = param
            .storage::<SharedCpuParam>()
            .filter(|_| param.device() == Device::Cpu)
            .ok_or_else(|| {
                Error::invalid(
                    "share param",
                    format!("storage from {} cannot be used on the CPU", param.device()),
                )
            })?;
        self.set_shared_param(index, buffer)
    }

    fn input_staging(&mut self, index: usize) -> Result<&mut [u8]> {
        self.input_bytes_mut(index)
    }

    fn submit(&mut self) -> Result<()> {
        self.execute()
    }

    fn wait(&mut self) -> Result<()> {
        Ok(())
    }

    fn sync_outputs(&mut self) -> Result<()> {
        Ok(())
    }

    fn value_bytes(&self, node: NodeId) -> Result<&[u8]> {
        CpuProgram::value_bytes(self, node)
    }

    fn set_active_rows(&mut self, inputs: &[NodeId], rows: usize) -> Result<()> {
        CpuProgram::set_active_rows(self, inputs, rows)
    }

    fn read_handle(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.handle_bytes(index)?;
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch {
                kind: "handle",
                name: format!("#{index}"),
                expected: src.len(),
                got: dst.len(),
                unit: "bytes",
            });
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn write_handle(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        CpuProgram::write_handle(self, index, bytes)
    }

    fn take_handle(&mut self, index: usize) -> Result<HandleStorage> {
        Ok(HandleStorage::new(
            Device::Cpu,
            CpuProgram::take_handle(self, index)?,
        ))
    }

    fn put_handle(&mut self, index: usize, storage: HandleStorage) -> Result<()> {
        let buffer = storage.into_inner::<Buffer>().map_err(|s| {
            Error::invalid(
                "put_handle",
                format!("storage from {} is not a CPU buffer", s.device()),
            )
        })?;
        CpuProgram::put_handle(self, index, buffer)
    }

    fn arena_ptr(&self) -> Option<*const u8> {
        Some(CpuProgram::arena_ptr(self))
    }

    fn set_profiling(&mut self, on: bool) {
        CpuProgram::set_profiling(self, on)
    }

    fn profile(&self) -> Option<Profile> {
        CpuProgram::profile(self)
    }

    fn clone_box(&self) -> Box<dyn Executable> {
        Box::new(self.clone())
    }
}
