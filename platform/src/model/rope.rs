//! Rotary position embedding tables, computed the way transformers computes them.

use super::config::{ModelConfig, RopeScaling};

/// Inverse frequencies per rotary pair, with the configured scaling applied.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: RopeScaling) -> Vec<f32> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            // transformers: 1 / theta^(arange(0, dim, 2) / dim), in float32.
            let exponent = (2 * i) as f32 / head_dim as f32;
            let base = (1.0 / theta.powf(exponent as f64)) as f32;
            match scaling {
                RopeScaling::Default => base,
                RopeScaling::Linear { factor } => base / factor as f32,
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
                    let f = base as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                    let scaled = if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    scaled as f32
                }
            }
        })
        .collect()
}

/// `[max_positions, head_dim]`: for each position, `head_dim / 2` cosines then as many sines.
pub fn cos_sin_table(config: &ModelConfig) -> Vec<f32> {
    let inv = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling);
    let half = inv.len();
    let mut table = vec![0f32; config.max_position_embeddings * config.head_dim];
    for (pos, row) in table.chunks_exact_mut(config.head_dim).enumerate() {
        for (i, &f) in inv.iter().enumerate() {
            // The angle is rounded to f32 as transformers does, then its cosine and sine taken.
            let angle = (pos as f32 * f) as f64;
            row[i] = angle.cos() as f32;
            row[half + i] = angle.sin() as f32;
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies() {
        let f = inv_freq(8, 10_000.0, RopeScaling::Default);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(want) {
            assert!((a - b).abs() < 1e-7 * (1.0 + b), "{a} vs {b}");
        }
        let lin = inv_freq(8, 10_000.0, RopeScaling::Linear { factor: 4.0 });
        assert!((lin[1] - 0.025).abs() < 1e-8);
    }

    #[test]
    fn llama3_scales_only_low_frequencies() {
        let s = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 };
        let base = inv_freq(128, 500_000.0, RopeScaling::Default);
        let scaled = inv_freq(128, 500_000.0, s);
        // Highest frequency (short wavelength) untouched; lowest divided by the factor.
        assert_eq!(base[0], scaled[0]);
        assert!((scaled[63] - base[63] / 8.0).abs() < 1e-12);
        // Somewhere in between the smooth blend lies strictly between the two.
        let mid = (0..64).find(|&i| scaled[i] != base[i] && (scaled[i] - base[i] / 8.0).abs() > 1e-12).unwrap();
        assert!(scaled[mid] < base[mid] && scaled[mid] > base[mid] / 8.0);
    }
}
