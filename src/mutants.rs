//! Seeded bugs: clippers that reproduce failure modes found in real DP libraries
//! (docs/detection.md). The oracle is worth its power to catch every one of them.
//!
//! Each mutant is one row of one table: its name, the verdict the audit owes it, the coarsest
//! precision at which it is a bug, the library behaviour it reproduces, and how it deviates from
//! exact tied ghost clipping ([`Deviation`]). The columns of a deviation are the points where a
//! DP step can go wrong: how norms are formed (`norms`), which loss they are of (`loss`), and
//! the clipping norm, clipped sum, noise and divisor of the step (`step`). A row names the
//! columns it changes; every other column is the exact behaviour, [`Deviation::EXACT`].

mod loss;
mod norms;
mod step;

use crate::clippers::{
    clip_coefficients, noisy_update_by, Clipped, Clipper, NoiseSpec, NormReport, Stepped,
};
use crate::error::Result;
use crate::options::ClipNorm;
use crate::trace::{Precision, Trace};
use loss::Loss;
use norms::{GramIn, NormScale, OwnNorm, Shared, SquaresIn};
use step::{ClipAt, Divisor, Noise, Sum};

/// What the audit must say about a mutant wherever it catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpectedVerdict {
    /// Under-estimates norms: a privacy violation wherever an affected example is clipped.
    PrivacyViolation,
    /// Over-estimates only (safe): never a privacy violation, a utility distortion somewhere.
    NeverPrivacyViolation,
    /// Either direction depending on the data: flagged somewhere.
    Flagged,
}

/// What a seeded bug corrupts, and so what an audit has to judge to see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corrupts {
    /// The per-example norms or coefficients: seen by every audit.
    Norms,
    /// The clipped sum, the divisor or the loss the step is of: seen when the step is judged.
    Step,
    /// Only the noise: seen when the step is judged under noise (σ > 0).
    Noise,
}

/// How a mutant deviates from exact tied ghost clipping, one column per point where a DP step
/// can go wrong. Every column's enum is matched exhaustively where it acts, so a new way to go
/// wrong is a compile error wherever it is not handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deviation {
    /// The dtype the Gram products accumulate in.
    pub gram: GramIn,
    /// How a site's own norm² is formed.
    pub own_norm: OwnNorm,
    /// How the sites of a shared parameter combine.
    pub shared: Shared,
    /// A factor on every norm.
    pub norm_scale: NormScale,
    /// The arithmetic of each norm's final sum of squares.
    pub squares_in: SquaresIn,
    /// The loss whose per-example gradients are clipped.
    pub loss: Loss,
    /// The clipping norm the coefficients use.
    pub clip_at: ClipAt,
    /// The sum the coefficients weigh.
    pub sum: Sum,
    /// The noise's draws and where they are added.
    pub noise: Noise,
    /// What the noisy sum is divided by.
    pub divisor: Divisor,
}

impl Deviation {
    /// Exact tied ghost clipping and DP-SGD's step.
    pub const EXACT: Deviation = Deviation {
        gram: GramIn::ClipperDtype,
        own_norm: OwnNorm::Exact,
        shared: Shared::Exact,
        norm_scale: NormScale::Exact,
        squares_in: SquaresIn::ClipperDtype,
        loss: Loss::Stated,
        clip_at: ClipAt::Stated,
        sum: Sum::Clipped,
        noise: Noise::OncePerParameter,
        divisor: Divisor::Stated,
    };

    /// What the deviation corrupts first on the way from the norms to the update: a wrong
    /// loss or C corrupts the coefficients, so the norms. `None` for no deviation at all.
    const fn corrupts(&self) -> Option<Corrupts> {
        // Taken apart without `..`: a new column is a compile error here until it is placed.
        let Deviation {
            gram,
            own_norm,
            shared,
            norm_scale,
            squares_in,
            loss,
            clip_at,
            sum,
            noise,
            divisor,
        } = *self;
        if !matches!(gram, GramIn::ClipperDtype)
            || !matches!(own_norm, OwnNorm::Exact)
            || !matches!(shared, Shared::Exact)
            || !matches!(norm_scale, NormScale::Exact)
            || !matches!(squares_in, SquaresIn::ClipperDtype)
            || !matches!(loss, Loss::Stated)
            || !matches!(clip_at, ClipAt::Stated)
        {
            Some(Corrupts::Norms)
        } else if !matches!(sum, Sum::Clipped) || !matches!(divisor, Divisor::Stated) {
            Some(Corrupts::Step)
        } else if !matches!(noise, Noise::OncePerParameter) {
            Some(Corrupts::Noise)
        } else {
            None
        }
    }
}

/// The seeded bugs, from one table: variant, name, the verdict the audit owes it, the coarsest
/// precision at which the bug is still a bug, the columns of its [`Deviation`] that differ
/// from [`Deviation::EXACT`], and the library behaviour it reproduces. `ALL`, `name`, `parse`,
/// `expected`, `visible_at`, `deviation` and `reproduces` are generated from it, so no list is
/// kept in sync by hand and no mutant lacks an expectation; a row that deviates nowhere does
/// not compile.
macro_rules! mutants {
    ($($variant:ident, $name:literal, $expected:ident, $coarsest:ident,
        { $($column:ident: $value:expr),+ $(,)? }, $reproduces:literal;)+) => {
        /// A seeded bug: exact tied ghost clipping with one deviation.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Mutant {
            $(#[doc = concat!("`", $name, "`: ", $reproduces)] $variant,)+
        }

        impl Mutant {
            /// Every mutant, in table order.
            pub const ALL: &'static [Mutant] = &[$(Mutant::$variant,)+];

            /// The mutant's name, as `--mutant` and reports know it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Mutant::$variant => $name,)+
                }
            }

            /// The library behaviour the mutant reproduces.
            pub fn reproduces(self) -> &'static str {
                match self {
                    $(Mutant::$variant => $reproduces,)+
                }
            }

            /// The verdict the audit owes the mutant.
            pub fn expected(self) -> ExpectedVerdict {
                match self {
                    $(Mutant::$variant => ExpectedVerdict::$expected,)+
                }
            }

            /// Whether the bug is a bug for a clipper computing in `precision`: a Gram taken in
            /// bf16 is exactly what a bf16 clipper does.
            pub fn visible_at(self, precision: Precision) -> bool {
                match self {
                    $(Mutant::$variant => precision <= Precision::$coarsest,)+
                }
            }

            /// How the mutant deviates from exact tied ghost clipping.
            pub const fn deviation(self) -> Deviation {
                match self {
                    $(Mutant::$variant => Deviation {
                        $($column: $value,)+
                        ..Deviation::EXACT
                    },)+
                }
            }

            /// The mutant called `name`, if one is.
            pub fn parse(name: &str) -> Option<Self> {
                Mutant::ALL.iter().copied().find(|m| m.name() == name)
            }
        }
    };
}

// The two Gram mutants are bugs only for a clipper that claims more precision than they keep:
// at bf16 both are what a correct clipper does, and at f16 a bf16 Gram's extra rounding stays
// inside the f16 bound on the built-in suite (the kill matrix at f16 shows it), so neither is
// claimed visible there.
mutants! {
    DropCross, "drop-cross", Flagged, BF16, { shared: Shared::NoCross },
        "tied sites summed as if disjoint (Opacus FSDP ghost class; JAX custom_vjp stacks)";
    LastWriter, "last-writer", Flagged, BF16, { shared: Shared::LastWriter },
        "per-sample norm overwritten by the last site computed in backward: embedding only (fastDP)";
    FirstWriter, "first-writer", Flagged, BF16, { shared: Shared::FirstWriter },
        "only the first site computed in backward kept: LM head only";
    CauchySchwarz, "cauchy-schwarz", NeverPrivacyViolation, BF16, { shared: Shared::CauchySchwarz },
        "sqrt(k·Σ‖G_j‖²) for a layer used k times (TF Privacy): safe, over-clips";
    NoRepeatMerge, "no-repeat-merge", Flagged, BF16, { own_norm: OwnNorm::EmbeddingWithoutRepeats },
        "embedding norm Σ_t‖e_t‖², ignoring repeated tokens";
    BiasFrobenius, "bias-frobenius", Flagged, BF16, { own_norm: OwnNorm::BiasFrobenius },
        "bias norm² as ‖ΔΔᵀ‖_F instead of Σ(ΔΔᵀ) (Opacus before PR 751)";
    SequenceCollapse, "sequence-collapse", Flagged, BF16, { own_norm: OwnNorm::SequenceCollapsed },
        "non-sequence formula ‖Σ_t δ_t‖·‖Σ_t a_t‖ applied to sequences";
    BatchMeanLoss, "batch-mean-loss", PrivacyViolation, BF16, { norm_scale: NormScale::BatchMean },
        "norms of the batch-mean loss: 1/B too small";
    F16NormUnderflow, "f16-norm-underflow", PrivacyViolation, F32, { squares_in: SquaresIn::F16 },
        "per-example norm's squares summed in f16: small squares underflow, the norm comes out low or 0 and the example unclipped (jax_privacy #309)";
    F16Gram, "f16-gram", Flagged, F32, { gram: GramIn::F16 },
        "Gram matrices accumulated in f16";
    Bf16Gram, "bf16-gram", Flagged, F32, { gram: GramIn::Bf16 },
        "Gram matrices accumulated in bf16";
    FlippedCross, "flipped-cross", Flagged, BF16, { shared: Shared::FlippedCross },
        "cross term with the wrong sign";
    TiedNoisePerUse, "tied-noise-per-use", NeverPrivacyViolation, BF16, { noise: Noise::OncePerUse },
        "noise added once per use of a shared weight: twice the variance on a tied embedding";
    NoTiedNoise, "no-tied-noise", PrivacyViolation, BF16, { noise: Noise::NoneOnShared },
        "no noise on the tied weight (FlashDP's GPT-2 example trains the tied head without it)";
    TiedHeadUnclipped, "tied-head-unclipped", Flagged, BF16, { sum: Sum::HeadPathUnclipped },
        "the tied head's output path summed unclipped (FlashDP's GPT-2 example)";
    DefaultClipNorm, "default-clip-norm", Flagged, BF16, { clip_at: ClipAt::One },
        "clipping at a default C = 1 while the noise uses the stated C (Opacus #664; fastDP's undefined C)";
    ActualBatchDivisor, "actual-batch-divisor", NeverPrivacyViolation, BF16, { divisor: Divisor::DrawnBatchSize },
        "update divided by the batch's actual size, not the stated expected size (Opacus #571, #819)";
    MicrobatchOverwrite, "microbatch-overwrite", NeverPrivacyViolation, BF16, { sum: Sum::LastMicrobatch },
        "the second micro-batch's clipped sum overwrites the first's (Opacus ghost mode's two backwards; #707)";
    NoiseAfterDivision, "noise-after-division", NeverPrivacyViolation, BF16, { noise: Noise::AfterDivision },
        "noise N(0, σ²C²) added after the division by the batch size: noise calibrated for the sum added to the mean (jax_privacy #234, #383)";
    NoiseOverAccumulation, "noise-over-accumulation", PrivacyViolation, BF16, { noise: Noise::MultiplierOverAccumulation },
        "noise multiplier divided by the gradient accumulation steps while the accumulated sum is noised once (jax_privacy's Gemma 3 example)";
    IgnoredTokenMean, "ignored-token-mean", Flagged, BF16, { loss: Loss::MeanOverAllPositions },
        "each example's loss averaged over all T positions, ignored ones included (Opacus #792)";
}

// A mutant that deviates nowhere is exact tied ghost clipping, not a seeded bug.
const _: () = {
    let mut k = 0;
    while k < Mutant::ALL.len() {
        assert!(
            Mutant::ALL[k].deviation().corrupts().is_some(),
            "a mutant's row names no deviation"
        );
        k += 1;
    }
};

impl Mutant {
    /// What the bug corrupts: an audit that judges less cannot see it.
    pub fn corrupts(self) -> Corrupts {
        self.deviation()
            .corrupts()
            .expect("every mutant deviates somewhere (checked when compiled)")
    }
}

/// A clipper with one seeded bug; otherwise exact tied ghost clipping.
#[derive(Clone, Copy, Debug)]
pub struct MutantClipper(pub Mutant);

impl Clipper for MutantClipper {
    fn name(&self) -> String {
        format!("mutant:{}", self.0.name())
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
        self.0.deviation().norms(trace)
    }

    /// The norms of the deviation's loss, clipped at its C, and the sum it forms from the
    /// coefficients.
    fn clip(&self, trace: &Trace, max_grad_norm: ClipNorm) -> Result<Clipped> {
        let deviation = self.0.deviation();
        let trace = deviation.loss.trace(trace)?;
        let report = deviation.norms(&trace)?;
        let coefficients = clip_coefficients(&report.norms, deviation.clip_at.of(max_grad_norm));
        let clipped_sum = deviation.sum.of(&trace, &coefficients)?;
        Ok(Clipped {
            report,
            coefficients,
            clipped_sum,
        })
    }

    /// [`Clipper::clip`], then the deviation's noise and divisor.
    fn step(&self, trace: &Trace, max_grad_norm: ClipNorm, noise: &NoiseSpec) -> Result<Stepped> {
        let deviation = self.0.deviation();
        let clipped = self.clip(trace, max_grad_norm)?;
        let params = trace.params();
        let uses = |param: &str| {
            params
                .iter()
                .find(|p| p.param == param)
                .map_or(1, |p| p.sites.len())
        };
        let noise = NoiseSpec {
            divisor: deviation.divisor.of(trace, noise),
            std: deviation.noise.std(noise.std),
            ..*noise
        };
        let update = noisy_update_by(
            &clipped.clipped_sum,
            &noise,
            &|param| deviation.noise.draws(uses(param)),
            deviation.noise.order(),
        )?;
        Ok(Stepped { clipped, update })
    }
}
