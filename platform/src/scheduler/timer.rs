//! What a step costs in time: a fixed part (reading the weights, launching the layers) plus a
//! part that grows with the step's cost. A least-squares line through recent steps' (cost,
//! seconds), older steps weighing less, gives the fixed part in units of cost: the work a step
//! can carry for about as long again as it takes anyway.

/// Weight of the steps before the latest one (a half-life of about 350 steps).
const DECAY: f64 = 0.998;
/// Steps observed before the line is trusted.
const MIN_STEPS: f64 = 32.0;

#[derive(Debug, Clone, Default)]
pub(super) struct StepTimer {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl StepTimer {
    /// Adds a step that cost `cost` and took `seconds`.
    pub fn observe(&mut self, cost: f64, seconds: f64) {
        if !(cost.is_finite() && seconds.is_finite() && cost > 0.0 && seconds >= 0.0) {
            return;
        }
        self.n = self.n * DECAY + 1.0;
        self.x = self.x * DECAY + cost;
        self.y = self.y * DECAY + seconds;
        self.xx = self.xx * DECAY + cost * cost;
        self.xy = self.xy * DECAY + cost * seconds;
    }

    /// A step's fixed time in units of cost (intercept over slope), once enough steps of
    /// different costs were seen and the line is meaningful (both positive).
    pub fn overhead(&self) -> Option<f64> {
        if self.n < MIN_STEPS {
            return None;
        }
        let (mx, my) = (self.x / self.n, self.y / self.n);
        let var = self.xx / self.n - mx * mx;
        // Steps that all cost about the same say nothing about the slope.
        if var <= (0.05 * mx).powi(2) {
            return None;
        }
        let slope = (self.xy / self.n - mx * my) / var;
        let intercept = my - slope * mx;
        (slope > 0.0 && intercept > 0.0).then(|| intercept / slope).filter(|v| v.is_finite())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_part_of_a_step_is_found_in_units_of_cost() {
        let mut t = StepTimer::default();
        for i in 0..200 {
            let cost = 1.0 + (i % 64) as f64;
            // 20 ms fixed, 1.25 ms per unit: the fixed part is 16 units.
            t.observe(cost, 0.020 + 0.00125 * cost);
        }
        let o = t.overhead().unwrap();
        assert!((o - 16.0).abs() < 1e-6, "{o}");
    }

    #[test]
    fn too_few_or_too_alike_steps_say_nothing() {
        let mut t = StepTimer::default();
        for _ in 0..10 {
            t.observe(8.0, 0.03);
        }
        assert_eq!(t.overhead(), None);
        for _ in 0..100 {
            t.observe(8.0, 0.03);
        }
        assert_eq!(t.overhead(), None, "every step cost the same");
        let mut t = StepTimer::default();
        for i in 0..100 {
            // Time falling with cost is noise, not a line to trust.
            t.observe(1.0 + i as f64, 0.1 - 0.0005 * i as f64);
        }
        assert_eq!(t.overhead(), None);
        t.observe(f64::NAN, 1.0);
        t.observe(1.0, f64::INFINITY);
    }
}
