//! What the HTTP layer needs of the serving runtime, as an object: handlers do not depend on
//! which backend the runtime was started with.

use std::sync::Arc;

use futures::future::LocalBoxFuture;
use loraplex_adapters::{AdapterLimits, BaseShape};
use loraplex_kernels::Backend;

use crate::memory::{AdapterRef, Residency};
use crate::model::ModelConfig;
use crate::request::{GenerationRequest, ValidRequest};
use crate::runtime::{HoldError, Holder, PoolShape, RequestHandle, Runtime, SubmitError, WorkerLocations, WorkerStats};
use crate::scheduler::Placement;

pub trait Serving: Send + Sync + 'static {
    fn model_config(&self) -> &ModelConfig;
    fn base_shape(&self) -> &BaseShape;
    fn adapter_limits(&self) -> &AdapterLimits;
    fn device_name(&self) -> &str;
    fn pool_shape(&self) -> PoolShape;
    fn validate(&self, request: GenerationRequest) -> Result<ValidRequest, SubmitError>;
    fn submit(&self, request: ValidRequest, placement: Placement) -> LocalBoxFuture<'_, Result<RequestHandle, SubmitError>>;
    fn stats(&self) -> LocalBoxFuture<'_, Vec<WorkerStats>>;
    fn load_adapter(&self, adapter: AdapterRef, holder: Option<Holder>) -> LocalBoxFuture<'_, Vec<Result<Residency, HoldError>>>;
    fn unload_adapter(&self, key: Arc<str>, holder: Arc<str>, forget: bool) -> LocalBoxFuture<'_, bool>;
    fn locate_adapters(&self, keys: Arc<[Arc<str>]>) -> LocalBoxFuture<'_, Vec<WorkerLocations>>;
}

impl<B: Backend> Serving for Runtime<B> {
    fn model_config(&self) -> &ModelConfig {
        Runtime::model_config(self)
    }

    fn base_shape(&self) -> &BaseShape {
        Runtime::base_shape(self)
    }

    fn adapter_limits(&self) -> &AdapterLimits {
        Runtime::adapter_limits(self)
    }

    fn device_name(&self) -> &str {
        Runtime::device_name(self)
    }

    fn pool_shape(&self) -> PoolShape {
        Runtime::pool_shape(self)
    }

    fn validate(&self, request: GenerationRequest) -> Result<ValidRequest, SubmitError> {
        Runtime::validate(self, request)
    }

    fn submit(&self, request: ValidRequest, placement: Placement) -> LocalBoxFuture<'_, Result<RequestHandle, SubmitError>> {
        Box::pin(self.submit_valid(request, placement))
    }

    fn stats(&self) -> LocalBoxFuture<'_, Vec<WorkerStats>> {
        Box::pin(Runtime::stats(self))
    }

    fn load_adapter(&self, adapter: AdapterRef, holder: Option<Holder>) -> LocalBoxFuture<'_, Vec<Result<Residency, HoldError>>> {
        Box::pin(Runtime::load_adapter(self, adapter, holder))
    }

    fn unload_adapter(&self, key: Arc<str>, holder: Arc<str>, forget: bool) -> LocalBoxFuture<'_, bool> {
        Box::pin(Runtime::unload_adapter(self, key, holder, forget))
    }

    fn locate_adapters(&self, keys: Arc<[Arc<str>]>) -> LocalBoxFuture<'_, Vec<WorkerLocations>> {
        Box::pin(Runtime::locate_adapters(self, keys))
    }
}
