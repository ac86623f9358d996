//! The `Clipper` trait and the built-in clippers: `materialize`, `ghost` and `ghost-tied`, all
//! built on the Gram identity in [`gram`].

mod ghost;
pub mod gram;
mod materialize;
mod tied;

pub use ghost::GhostClipper;
pub use materialize::MaterializeClipper;
pub use tied::TiedGhostClipper;

use crate::error::Result;
use crate::options::ClipNorm;
use crate::trace::{Precision, Trace};
use candle_core::{DType, Tensor};
use gram::Factored;

/// ⟨G_j, G_k⟩ per example for two sites of one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossTerm {
    /// The parameter the two sites write.
    pub param: String,
    /// Indices of the two sites in the trace.
    pub sites: (usize, usize),
    /// ⟨G_j, G_k⟩ for each example, in batch order.
    pub values: Vec<f64>,
}

/// Per-example norms with the parts they were summed from.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NormReport {
    /// The norm each example is clipped by.
    pub norms: Vec<f64>,
    /// `site_sq[j][i]`: site j's own squared norm for example i, as this clipper computed it.
    pub site_sq: Vec<Vec<f64>>,
    /// Cross terms this clipper included (empty for `ghost`).
    pub cross: Vec<CrossTerm>,
    /// Things a user must know (e.g. `ghost` ignoring a shared parameter).
    pub warnings: Vec<String>,
}

/// What a clipper hands the optimizer: coefficients and the clipped gradient sum Σ_i c_i g_i.
#[derive(Clone, Debug)]
pub struct Clipped {
    /// The per-example norms and their parts.
    pub report: NormReport,
    /// c_i for each example, from its norm and C.
    pub coefficients: Vec<f64>,
    /// (parameter, Σ_i c_i g_i in the parameter's layout), in first-use order.
    pub clipped_sum: Vec<(String, Tensor)>,
}

/// How the noisy DP-SGD step is formed from a clipped sum: noise N(0, σ²C²) on every entry of
/// every parameter, drawn from a seeded ChaCha8 stream, then the division by `divisor`.
#[derive(Clone, Copy, Debug)]
pub struct NoiseSpec {
    /// σC, the noise's standard deviation.
    pub std: f64,
    /// D, what the noisy sum is divided by (the expected or actual batch size).
    pub divisor: f64,
    /// Seed of the ChaCha8 stream the noise is drawn from.
    pub seed: u64,
}

/// The update a clipper steps with: (Σ_i c_i g_i + σC ξ) / D per parameter, in first-use order.
pub fn noisy_update(
    clipped_sum: &[(String, Tensor)],
    noise: &NoiseSpec,
) -> Result<Vec<(String, Tensor)>> {
    noisy_update_by(clipped_sum, noise, &|_| 1, NoiseOrder::BeforeDivision)
}

/// Where the noise goes relative to the division by D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoiseOrder {
    /// (K + σCξ) / D: DP-SGD.
    BeforeDivision,
    /// K / D + σCξ: the noise D times too large next to the signal.
    AfterDivision,
}

/// [`noisy_update`] with `draws(param)` independent draws of N(0, σ²C²) added to a parameter
/// (1 in DP-SGD; seeded bugs draw 0, or once per use of a shared weight), in one ChaCha8 stream.
pub(crate) fn noisy_update_by(
    clipped_sum: &[(String, Tensor)],
    noise: &NoiseSpec,
    draws: &dyn Fn(&str) -> usize,
    order: NoiseOrder,
) -> Result<Vec<(String, Tensor)>> {
    clipped_sum
        .iter()
        .enumerate()
        .map(|(index, (p, k))| {
            let stream = (index as u64) << 32;
            let cpu = &candle_core::Device::Cpu;
            let flat = k.flatten_all()?;
            // One pass over the sum's values, in its own width (an f32 step's noise needs no f64
            // draws, and half the random bits); f16 and bf16 sums are noised in f32 and the
            // update rounded once.
            let update = match crate::trace::precision_of(k.dtype())? {
                Precision::F64 => {
                    let v = noised(flat.to_vec1::<f64>()?, noise, stream, draws(p), order);
                    Tensor::from_vec(v, k.shape(), cpu)?
                }
                Precision::F32 | Precision::F16 | Precision::BF16 => {
                    let v = flat.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    let v = noised(v, noise, stream, draws(p), order);
                    Tensor::from_vec(v, k.shape(), cpu)?.to_dtype(k.dtype())?
                }
            };
            Ok((p.clone(), update.to_device(k.device())?))
        })
        .collect()
}

/// Entries per chunk of noise: each chunk is its own ChaCha8 stream position, so the noise is
/// the same whatever the number of threads that draw it.
const NOISE_CHUNK: usize = 1 << 16;

/// The update from a clipped sum's values, in place: (K + σC·Σ_{k<draws} z_k) / D (or the noise
/// after the division), z ~ N(0, 1), chunk c drawn from the stream `stream + c` of the seed,
/// chunks spread over the machine's cores: a V×d head's noise is tens of millions of draws.
fn noised<T>(
    mut values: Vec<T>,
    noise: &NoiseSpec,
    stream: u64,
    draws: usize,
    order: NoiseOrder,
) -> Vec<T>
where
    T: candle_core::WithDType,
    rand_distr::StandardNormal: rand_distr::Distribution<T>,
{
    use rand_chacha::rand_core::SeedableRng;
    use rand_distr::Distribution;
    let std = T::from_f64(noise.std);
    let inv = T::from_f64(1.0 / noise.divisor);
    let fill = |c: usize, chunk: &mut [T]| {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(noise.seed);
        rng.set_stream(stream + c as u64);
        for x in chunk.iter_mut() {
            let mut xi = T::zero();
            for _ in 0..draws {
                let z: T = rand_distr::StandardNormal.sample(&mut rng);
                xi += std * z;
            }
            *x = match order {
                NoiseOrder::BeforeDivision => (*x + xi) * inv,
                NoiseOrder::AfterDivision => *x * inv + xi,
            };
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let chunks: Vec<(usize, &mut [T])> = values.chunks_mut(NOISE_CHUNK).enumerate().collect();
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [T])>> = Vec::new();
    for (k, item) in chunks.into_iter().enumerate() {
        if k % per_thread == 0 {
            groups.push(Vec::new());
        }
        groups.last_mut().expect("pushed above").push(item);
    }
    std::thread::scope(|scope| {
        for group in groups {
            scope.spawn(move || {
                for (c, chunk) in group {
                    fill(c, chunk);
                }
            });
        }
    });
    values
}

/// A clipper's DP-SGD step: what it clipped, and the update it steps with.
#[derive(Clone, Debug)]
pub struct Stepped {
    /// The clipped sum with the noisy update it steps with.
    pub clipped: Clipped,
    /// (parameter, update), in first-use order.
    pub update: Vec<(String, Tensor)>,
}

/// The interface a clipper backend implements. A clipper sees only the trace (per-site
/// factors); it must not run the model again.
///
/// ```
/// use ghost_oracle::{Clipper, TiedGhostClipper};
/// let clipper = TiedGhostClipper;
/// assert_eq!(clipper.name(), "ghost-tied");
/// ```
pub trait Clipper {
    /// The name the registry, the CLI and reports know the clipper by.
    fn name(&self) -> String;

    /// Per-example gradient norms from the trace, in the trace's dtype and device.
    fn norms(&self, trace: &Trace) -> Result<NormReport>;

    /// Norms, clipping coefficients c_i = min(1, C / n_i) and Σ_i c_i g_i from the factors.
    fn clip(&self, trace: &Trace, max_grad_norm: ClipNorm) -> Result<Clipped> {
        let report = self.norms(trace)?;
        let coefficients = clip_coefficients(&report.norms, max_grad_norm);
        let clipped_sum = clipped_sum(trace, &coefficients)?;
        Ok(Clipped {
            report,
            coefficients,
            clipped_sum,
        })
    }

    /// The DP-SGD step: [`Clipper::clip`], then N(0, σ²C²) on every entry and the division by
    /// the stated divisor ([`noisy_update`]). A backend whose step is its own overrides this.
    fn step(&self, trace: &Trace, max_grad_norm: ClipNorm, noise: &NoiseSpec) -> Result<Stepped> {
        let clipped = self.clip(trace, max_grad_norm)?;
        let update = noisy_update(&clipped.clipped_sum, noise)?;
        Ok(Stepped { clipped, update })
    }
}

/// c = min(1, C / n). A NaN norm gives a NaN coefficient rather than silently 1.
pub fn clip_coefficients(norms: &[f64], max_grad_norm: ClipNorm) -> Vec<f64> {
    let max_grad_norm = max_grad_norm.get();
    norms
        .iter()
        .map(|&n| {
            if n.is_nan() {
                f64::NAN
            } else if n > max_grad_norm {
                max_grad_norm / n
            } else {
                1.0
            }
        })
        .collect()
}

/// Σ_i c_i g_i per parameter, from the factors (one weighted product per site).
pub fn clipped_sum(trace: &Trace, coefficients: &[f64]) -> Result<Vec<(String, Tensor)>> {
    let dtype = trace.dtype();
    let w = Tensor::from_vec(coefficients.to_vec(), coefficients.len(), &trace.device())?
        .to_dtype(dtype)?;
    trace
        .params()
        .into_iter()
        .map(|p| {
            let mut acc: Option<Tensor> = None;
            for &j in &p.sites {
                let s = gram::weighted_sum(&Factored::of(&trace.sites[j])?, &w)?;
                acc = Some(match acc {
                    None => s,
                    Some(a) => (a + s)?,
                });
            }
            Ok((p.param, acc.expect("a parameter has at least one site")))
        })
        .collect()
}

pub(crate) fn own_norms(
    trace: &Trace,
    factored: &[Factored],
    dtype: DType,
) -> Result<Vec<Vec<f64>>> {
    factored
        .iter()
        .map(|f| {
            if f.prefers_gram() {
                gram::inner(f, f, dtype)
            } else {
                (0..trace.batch_size())
                    .map(|i| gram::sum_sq(&gram::materialize(f, i, dtype)?))
                    .collect()
            }
        })
        .collect()
}

pub(crate) fn factor_all(trace: &Trace) -> Result<Vec<Factored>> {
    trace.sites.iter().map(Factored::of).collect()
}

/// √n², with a negative n² reported as −√|n²| rather than clamped to 0: rounding can make a
/// tiny n² negative, a sign bug makes a large one, and only the judge can tell which. NaN stays
/// NaN.
pub(crate) fn signed_sqrt(n2: f64) -> f64 {
    if n2 < 0.0 {
        -(-n2).sqrt()
    } else {
        n2.sqrt()
    }
}

pub(crate) fn finish(
    site_sq: Vec<Vec<f64>>,
    cross: Vec<CrossTerm>,
    batch: usize,
    warnings: Vec<String>,
) -> NormReport {
    let norms = (0..batch)
        .map(|i| {
            let own: f64 = site_sq.iter().map(|s| s[i]).sum();
            let x: f64 = cross.iter().map(|c| 2.0 * c.values[i]).sum();
            signed_sqrt(own + x)
        })
        .collect();
    NormReport {
        norms,
        site_sq,
        cross,
        warnings,
    }
}
