//! Admission control: a bound on the sequences queued and running on the whole server and on
//! each tenant's, decided before any expensive work (tokenizing, templating, the ledger).
//!
//! A request counts its sequences (prompts times samples). Past its tenant's bound it is refused
//! with 429. When the server's bound would be passed it is refused too: with 429 if its tenant
//! already holds more than its fair share of the server (the bound split by weight among the
//! tenants with work in flight), else with 503: the server is full and the tenant is not the one
//! filling it. Either way with a Retry-After.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::ApiError;

/// The bounds, in sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Sequences queued or running on the server.
    pub max_pending: u32,
    /// Sequences queued or running for one tenant.
    pub max_pending_per_tenant: u32,
}

#[derive(Debug, Default)]
struct State {
    total: u64,
    /// Tenant -> (sequences in flight, weight).
    tenants: HashMap<String, (u64, f64)>,
}

#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    state: Mutex<State>,
}

/// Admitted sequences; they leave the count when this is dropped.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    tenant: String,
    units: u64,
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Arc<Self> {
        Arc::new(Self { config, state: Mutex::new(State::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits `units` sequences of `tenant` (of plan weight `weight`), or says why not.
    pub fn admit(self: &Arc<Self>, tenant: &str, weight: f64, units: u32) -> Result<Slot, ApiError> {
        let units = u64::from(units.max(1));
        let (max, per_tenant) = (u64::from(self.config.max_pending), u64::from(self.config.max_pending_per_tenant));
        if units > per_tenant.min(max) {
            return Err(ApiError::Invalid(format!(
                "this request asks for {units} sequences (prompts times n); at most {} may be in flight for one tenant",
                per_tenant.min(max)
            )));
        }
        let mut s = self.lock();
        let mine = s.tenants.get(tenant).map_or(0, |t| t.0);
        if mine + units > per_tenant {
            return Err(ApiError::RateLimited {
                message: format!("too many requests in flight: {mine} of your {per_tenant} sequences are queued or running"),
                retry_after: 1,
            });
        }
        if s.total + units > max {
            // The server is full; is this tenant the one holding more than its share?
            let weights: f64 = s.tenants.iter().filter(|(t, e)| e.0 > 0 && t.as_str() != tenant).map(|(_, e)| e.1).sum::<f64>() + weight;
            let share = max as f64 * weight / weights;
            if (mine + units) as f64 > share {
                return Err(ApiError::RateLimited {
                    message: format!("the server is full and you have {mine} sequences in flight, more than your share of {}", share.floor()),
                    retry_after: 1,
                });
            }
            return Err(ApiError::Overloaded { message: format!("the server is full: {} sequences are queued or running", s.total), retry_after: 1 });
        }
        s.total += units;
        let entry = s.tenants.entry(tenant.to_string()).or_insert((0, weight));
        entry.0 += units;
        entry.1 = weight;
        Ok(Slot { admission: self.clone(), tenant: tenant.to_string(), units })
    }

    /// Sequences in flight on the server, and of `tenant`.
    pub fn pending(&self, tenant: &str) -> (u64, u64) {
        let s = self.lock();
        (s.total, s.tenants.get(tenant).map_or(0, |t| t.0))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.admission.lock();
        s.total = s.total.saturating_sub(self.units);
        if let Some(t) = s.tenants.get_mut(&self.tenant) {
            t.0 = t.0.saturating_sub(self.units);
            if t.0 == 0 {
                s.tenants.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_over_its_share_gets_429_and_a_full_server_503() {
        let a = Admission::new(AdmissionConfig { max_pending: 10, max_pending_per_tenant: 8 });
        let hog: Vec<Slot> = (0..8).map(|_| a.admit("hog", 1.0, 1).unwrap()).collect();
        // Its own bound.
        assert!(matches!(a.admit("hog", 1.0, 1), Err(ApiError::RateLimited { .. })));
        let mut small = vec![a.admit("small", 1.0, 2).unwrap()];
        assert_eq!(a.pending("hog"), (10, 8));
        // Full: the hog holds 8 of 10, above its half: 429. The small tenant holds 2, below its
        // half: 503, the server is full.
        assert!(matches!(a.admit("hog", 1.0, 1), Err(ApiError::RateLimited { .. })));
        assert!(matches!(a.admit("small", 1.0, 1), Err(ApiError::Overloaded { retry_after: 1, .. })));
        // A newcomer's share is a third.
        assert!(matches!(a.admit("new", 1.0, 1), Err(ApiError::Overloaded { .. })));
        drop(hog);
        assert_eq!(a.pending("hog"), (2, 0));
        small.push(a.admit("small", 1.0, 6).unwrap());
        // A request that could never be admitted is a client error.
        assert!(matches!(a.admit("x", 1.0, 9), Err(ApiError::Invalid(_))));
        drop(small);
        assert_eq!(a.pending("small"), (0, 0));
    }
}
