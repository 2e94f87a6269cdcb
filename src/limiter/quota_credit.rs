//! The credit that pays for bucket starts. Envoy starts every changed token bucket full, so a
//! start hands its proxy `max_tokens` at once, over and above the refill. Each bucket id keeps a
//! ledger: the pool earns its rate (the whole budget, or the grant Redis holds for this server),
//! the assignments in force spend their refill rates, and each bucket start spends its depth.
//! A start waits until the credit covers it, and the credit is capped at `burst + members`, so
//! over any interval the refills and starts together never pass what the pool earned plus one
//! cap: that is the bound of `docs/algorithms.md` ("Quota shares").

use super::{Assignment, Bucket, Pool, Shares};

impl Shares {
    /// Brings the bucket's credit up to `now_us`: what the pool earned since the last update,
    /// less what every assignment in force could refill meanwhile (a vanished member's included,
    /// until its TTL ends), capped at the burst and one token a member. Nothing is earned during
    /// the hold-down after a start, nor after a lease has ended.
    pub(super) fn accrue(&self, state: &mut Bucket, now_us: u64) {
        let from = state.credit_us.max(self.hold_until_us);
        state.credit_us = state.credit_us.max(now_us);
        if now_us <= from {
            return;
        }
        let seconds = |until: u64| until.min(now_us).saturating_sub(from) as f64 / 1e6;
        let earned = match state.pool {
            Pool::Whole => state.budget.rate * seconds(u64::MAX),
            Pool::Leased {
                grant, until_us, ..
            } => grant * seconds(until_us),
        };
        let f = f64::from(self.timing.fill_interval_s);
        let spent: f64 = state
            .members
            .values()
            .map(|m| f64::from(m.current.map_or(0, Assignment::tokens)) / f * seconds(m.expires_us))
            .sum();
        let cap = super::burst_share(state) + state.members.len() as f64;
        // Spending can pass earning only while a lowered budget (a reload, an override) still
        // has assignments above its new rate out: the credit stays at zero then, and the new
        // rate's bound holds from when those proxies have been lowered.
        state.credit = (state.credit + earned - spent).clamp(0.0, cap);
    }
}
