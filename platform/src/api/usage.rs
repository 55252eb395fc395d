//! Usage and bills: `GET /v1/usage` (a tenant's own, grouped by day or adapter) and
//! `GET /admin/billing/report` (every tenant, JSON or CSV). Both read the ledger.

use std::collections::BTreeMap;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

use super::infer;
use super::{ApiError, AppState, authorize, parse_query};
use crate::store::{BillingLine, Scope, TenantTotals, Totals, date, now_ms};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/usage", web::get().to(usage)).route("/admin/billing/report", web::get().to(report));
}

/// Day number of a `YYYY-MM-DD` date.
fn day_of(date: &str) -> Option<i64> {
    let mut parts = date.splitn(3, '-');
    let y: i64 = parts.next()?.parse().ok()?;
    let m: i64 = parts.next()?.parse().ok()?;
    let d: i64 = parts.next()?.parse().ok()?;
    // Four-digit years, as the format says: the arithmetic below then never overflows.
    if !(0..=9999).contains(&y) || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let day = era * 146_097 + doe - 719_468;
    // Reject days that do not exist (2026-02-30).
    (crate::store::date(day) == format!("{:04}-{:02}-{:02}", if m <= 2 { y + 1 } else { y }, m, d)).then_some(day)
}

/// A bound: Unix seconds, or a `YYYY-MM-DD` date (its midnight, UTC). In milliseconds.
fn bound(field: &str, v: Option<&str>, default: i64) -> Result<i64, ApiError> {
    let Some(v) = v else { return Ok(default) };
    if let Ok(secs) = v.parse::<i64>() {
        return secs.checked_mul(1000).ok_or_else(|| ApiError::Invalid(format!("`{field}` is out of range")));
    }
    day_of(v).map(|d| d * 86_400_000).ok_or_else(|| ApiError::Invalid(format!("`{field}` must be Unix seconds or a YYYY-MM-DD date; given {v:?}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageQuery {
    from: Option<String>,
    to: Option<String>,
    group_by: Option<String>,
}

/// Sums as JSON; `cost` is a decimal string of dollars, exact (see [`crate::store::Money`]).
fn totals_json(t: &Totals) -> serde_json::Value {
    json!({
        "requests": t.requests,
        "prompt_tokens": t.prompt_tokens,
        "cached_prompt_tokens": t.cached_prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": t.total_tokens(),
        "cost": t.cost,
    })
}

/// A report line, with the same fields and values as its CSV row.
fn line_json(l: &BillingLine) -> serde_json::Value {
    let mut v = totals_json(&l.totals);
    v["tenant_id"] = l.tenant_id.clone().into();
    v["tenant"] = l.tenant.clone().into();
    v["plan"] = l.plan.clone().into();
    v["adapter"] = l.adapter.clone().into();
    v["date"] = date(l.day).into();
    v
}

fn tenant_json(id: &str, t: &TenantTotals) -> serde_json::Value {
    let mut v = totals_json(&t.totals);
    v["tenant_id"] = id.into();
    v["tenant"] = t.tenant.clone().into();
    v
}

async fn usage(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let q: UsageQuery = parse_query(&req)?;
    let from = bound("from", q.from.as_deref(), 0)?;
    let to = bound("to", q.to.as_deref(), now_ms() + 1)?;
    let report = state.store.billing_report(from, to, Some(&caller.tenant.id)).await?;
    let data: Vec<serde_json::Value> = match q.group_by.as_deref() {
        None => report.lines.iter().map(line_json).collect(),
        Some("day") => {
            let mut by: BTreeMap<i64, Totals> = BTreeMap::new();
            for l in &report.lines {
                by.entry(l.day).or_default().add(&l.totals)?;
            }
            by.iter()
                .map(|(d, t)| {
                    let mut v = totals_json(t);
                    v["date"] = date(*d).into();
                    v
                })
                .collect()
        }
        Some("adapter") => {
            let mut by: BTreeMap<&str, Totals> = BTreeMap::new();
            for l in &report.lines {
                by.entry(&l.adapter).or_default().add(&l.totals)?;
            }
            by.iter()
                .map(|(a, t)| {
                    let mut v = totals_json(t);
                    v["adapter"] = (*a).into();
                    v
                })
                .collect()
        }
        Some(other) => return Err(ApiError::Invalid(format!("`group_by` must be `day` or `adapter`; given {other:?}"))),
    };
    Ok(HttpResponse::Ok().json(json!({
        "object": "usage",
        "tenant_id": caller.tenant.id,
        "from": from / 1000,
        "to": to / 1000,
        "group_by": q.group_by,
        "data": data,
        "totals": totals_json(&report.totals),
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportQuery {
    from: Option<String>,
    to: Option<String>,
    format: Option<String>,
    tenant_id: Option<String>,
}

async fn report(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let q: ReportQuery = parse_query(&req)?;
    let from = bound("from", q.from.as_deref(), 0)?;
    let to = bound("to", q.to.as_deref(), now_ms() + 1)?;
    let report = state.store.billing_report(from, to, q.tenant_id.as_deref()).await?;
    match q.format.as_deref().unwrap_or("json") {
        "json" => {
            // The lines summed per tenant and adapter, and per day, exactly.
            let mut adapters: BTreeMap<(&str, &str), (&str, Totals)> = BTreeMap::new();
            let mut days: BTreeMap<i64, Totals> = BTreeMap::new();
            for l in &report.lines {
                adapters.entry((&l.tenant_id, &l.adapter)).or_insert_with(|| (&l.tenant, Totals::default())).1.add(&l.totals)?;
                days.entry(l.day).or_default().add(&l.totals)?;
            }
            let adapters: Vec<serde_json::Value> = adapters
                .iter()
                .map(|((tenant_id, adapter), (tenant, t))| {
                    let mut v = totals_json(t);
                    v["tenant_id"] = (*tenant_id).into();
                    v["tenant"] = (*tenant).into();
                    v["adapter"] = (*adapter).into();
                    v
                })
                .collect();
            let days: Vec<serde_json::Value> = days
                .iter()
                .map(|(d, t)| {
                    let mut v = totals_json(t);
                    v["date"] = date(*d).into();
                    v
                })
                .collect();
            Ok(HttpResponse::Ok().json(json!({
                "from": from / 1000,
                "to": to / 1000,
                "lines": report.lines.iter().map(line_json).collect::<Vec<_>>(),
                "tenants": report.tenants.iter().map(|(id, t)| tenant_json(id, t)).collect::<Vec<_>>(),
                "adapters": adapters,
                "days": days,
                "totals": totals_json(&report.totals),
            })))
        }
        "csv" => Ok(HttpResponse::Ok()
            .content_type("text/csv; charset=utf-8")
            .insert_header(("content-disposition", "attachment; filename=\"billing.csv\""))
            .body(report.to_csv())),
        other => Err(ApiError::Invalid(format!("`format` must be `json` or `csv`; given {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(20_413), "2025-11-21");
        for day in [-1000, 0, 59, 60, 11_016, 20_413, 100_000] {
            assert_eq!(day_of(&date(day)), Some(day), "{}", date(day));
        }
        assert_eq!(day_of("2026-02-30"), None);
        assert_eq!(day_of("2026-13-01"), None);
        assert!(bound("from", Some("yesterday"), 0).is_err());
        for huge in ["999999999999-01-01", "99999999999999999-01-01", "-5-01-01", "10000-01-01"] {
            assert!(bound("from", Some(huge), 0).is_err(), "{huge}");
        }
        assert_eq!(day_of("9999-12-31"), Some(2_932_896));
        assert!(bound("to", Some(&i64::MAX.to_string()), 0).is_err());
        assert_eq!(bound("from", Some("86400"), 0).unwrap(), 86_400_000);
    }
}
