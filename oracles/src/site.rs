//! What a site is: one use of a parameter, of one kind, whose factors a ghost clipper reads, and
//! the shape of the gradient it writes.

/// The site kinds, from one table: variant, the name traces use, and what it computes. The enum,
/// `ALL`, `name` and `parse` are generated from it, so a new kind cannot be left out of the
/// parser.
macro_rules! site_kinds {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        /// What a site is: the module whose inputs and output gradients it holds.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum SiteKind {
            $($(#[$doc])* $variant,)+
        }

        impl SiteKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [SiteKind] = &[$(SiteKind::$variant,)+];

            /// The kind's name in a trace's `sites` metadata.
            pub fn name(self) -> &'static str {
                match self {
                    $(SiteKind::$variant => $name,)+
                }
            }

            /// The kind a trace names `s`, if one is.
            pub fn parse(s: &str) -> Option<Self> {
                SiteKind::ALL.iter().copied().find(|k| k.name() == s)
            }
        }
    };
}

site_kinds! {
    /// `y = W a`, W out×in (nn.Linear).
    Linear => "linear",
    /// `y = a W`, W in×out (HF Conv1D).
    Conv1d => "conv1d",
    /// `y_t = E[x_t]`.
    Embedding => "embedding",
    /// `y = x + b`.
    Bias => "bias",
    /// The weight of a LayerNorm: `y = x̂ ⊙ w`.
    LayerNorm => "layernorm",
}

impl SiteKind {
    /// Whether the site's factors include its input (`<name>.activations`; for a layernorm the
    /// normalized input x̂).
    pub fn needs_activations(self) -> bool {
        match self {
            SiteKind::Linear | SiteKind::Conv1d | SiteKind::LayerNorm => true,
            SiteKind::Embedding | SiteKind::Bias => false,
        }
    }

    /// Whether the site reads token ids (`<name>.ids`) and has a `vocab`.
    pub fn needs_ids(self) -> bool {
        match self {
            SiteKind::Embedding => true,
            SiteKind::Linear | SiteKind::Conv1d | SiteKind::LayerNorm | SiteKind::Bias => false,
        }
    }

    /// (rows, cols) of the gradient the site writes, in the parameter's layout, from the width
    /// of its backprops (`out`), of its activations (`input`, 0 when it has none) and its vocab.
    pub fn gradient_shape(self, out: usize, input: usize, vocab: Option<usize>) -> (usize, usize) {
        match self {
            SiteKind::Linear => (out, input),
            SiteKind::Conv1d => (input, out),
            SiteKind::Embedding => (vocab.unwrap_or(0), out),
            SiteKind::Bias | SiteKind::LayerNorm => (out, 1),
        }
    }
}

/// How a site is described in a trace header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteSpec {
    /// The prefix of the site's tensors in the trace file.
    pub name: String,
    /// The parameter whose gradient the site contributes to.
    pub param: String,
    /// What module the site is.
    pub kind: SiteKind,
    /// Rows of the table, for embeddings.
    pub vocab: Option<usize>,
}
