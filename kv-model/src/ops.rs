//! The layers' arithmetic on f32 slices.

use crate::weights::Matrix;

/// `x` normalised by its root mean square, times `gains`.
pub(crate) fn rms_norm(x: &[f32], gains: &[f32], eps: f32) -> Vec<f32> {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    x.iter().zip(gains).map(|(v, g)| v * scale * g).collect()
}

/// The dot product of `a` and `b`.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Rows `rows` of `m` times `x`.
pub(crate) fn matvec_rows(m: &Matrix, rows: std::ops::Range<usize>, x: &[f32]) -> Vec<f32> {
    rows.map(|r| dot(m.row(r), x)).collect()
}

/// `m` times `x`.
pub(crate) fn matvec(m: &Matrix, x: &[f32]) -> Vec<f32> {
    matvec_rows(m, 0..m.rows, x)
}

/// `m`'s columns `cols` times `x` (`x.len() == cols.len()`).
pub(crate) fn matvec_cols(m: &Matrix, cols: std::ops::Range<usize>, x: &[f32]) -> Vec<f32> {
    (0..m.rows)
        .map(|r| dot(&m.row(r)[cols.clone()], x))
        .collect()
}

/// Rotates each pair `(x[i], x[i + half])` of one head by the angle of `position` at the
/// pair's frequency (Llama's rotate-half form).
pub(crate) fn rope(head: &mut [f32], position: usize, theta: f32) {
    let half = head.len() / 2;
    for i in 0..half {
        let frequency = theta.powf(-((2 * i) as f32) / head.len() as f32);
        let (sin, cos) = (position as f32 * frequency).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = a * sin + b * cos;
    }
}

/// SiLU: `x · sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `scores` replaced by their softmax.
pub(crate) fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}
