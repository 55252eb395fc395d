//! Exact money. Prices are integer micro-dollars per million tokens, so a token count times a
//! price is an integer number of pico-dollars (10⁻¹² $): every amount here is that integer, summed
//! without rounding, and shown as a decimal string of dollars. No amount ever passes through a
//! float.

use serde::{Serialize, Serializer};

/// An amount in pico-dollars.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Money(i128);

/// Fractional digits of a dollar in one pico-dollar.
const SCALE_DIGITS: usize = 12;
const SCALE: i128 = 1_000_000_000_000;

/// At least this many fractional digits are shown (micro-dollars).
const MIN_DIGITS: usize = 6;

impl Money {
    pub const ZERO: Money = Money(0);

    /// `tokens` at `price` micro-dollars per million tokens.
    pub fn of(tokens: i64, price: i64) -> Money {
        // Both are at most 2^63 in magnitude: the product fits an i128.
        Money(i128::from(tokens) * i128::from(price))
    }

    pub fn pico(self) -> i128 {
        self.0
    }

    /// The sum, or `None` on overflow (far beyond any real bill).
    pub fn checked_add(self, other: Money) -> Option<Money> {
        self.0.checked_add(other.0).map(Money)
    }

    /// Dollars as a decimal string: all significant digits, at least six after the point
    /// (`"0.000500"`, `"12.3456789"`).
    pub fn dollars(self) -> String {
        let sign = if self.0 < 0 { "-" } else { "" };
        let abs = self.0.unsigned_abs();
        let whole = abs / SCALE as u128;
        let frac = format!("{:0width$}", abs % SCALE as u128, width = SCALE_DIGITS);
        let keep = frac.trim_end_matches('0').len().max(MIN_DIGITS);
        format!("{sign}{whole}.{}", &frac[..keep])
    }
}

impl std::fmt::Display for Money {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.dollars())
    }
}

/// As a JSON string of dollars, so that no client parses it into a float by accident.
impl Serialize for Money {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.dollars())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_exact_and_print_every_digit() {
        // 3 tokens at $0.50 per million: 1.5 micro-dollars, which no float rounding may lose.
        assert_eq!(Money::of(3, 500_000).dollars(), "0.0000015");
        assert_eq!(Money::of(1_000_000, 1_500_000).dollars(), "1.500000");
        assert_eq!(Money::ZERO.dollars(), "0.000000");
        assert_eq!(Money::of(1, 1).dollars(), "0.000000000001");
        assert_eq!(Money::of(-3, 500_000).dollars(), "-0.0000015");
        // A million requests of 1.5 micro-dollars each add up to exactly $1.50.
        let mut sum = Money::ZERO;
        for _ in 0..1_000_000 {
            sum = sum.checked_add(Money::of(3, 500_000)).unwrap();
        }
        assert_eq!(sum.dollars(), "1.500000");
        assert_eq!(serde_json::to_value(Money::of(7, 125_000)).unwrap(), serde_json::json!("0.000000875"));
        assert_eq!(Money(i128::MAX).checked_add(Money(1)), None);
    }
}
