//! What a site is: one use of a parameter, of one kind, whose factors a ghost clipper reads, and
//! the shape of the gradient it writes.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SiteKind {
    /// `y = W a`, W out×in (nn.Linear).
    Linear,
    /// `y = a W`, W in×out (HF Conv1D).
    Conv1d,
    /// `y_t = E[x_t]`.
    Embedding,
    /// `y = x + b`.
    Bias,
    /// The weight of a LayerNorm: `y = x̂ ⊙ w`.
    LayerNorm,
}

impl SiteKind {
    pub fn name(self) -> &'static str {
        match self {
            SiteKind::Linear => "linear",
            SiteKind::Conv1d => "conv1d",
            SiteKind::Embedding => "embedding",
            SiteKind::Bias => "bias",
            SiteKind::LayerNorm => "layernorm",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            SiteKind::Linear,
            SiteKind::Conv1d,
            SiteKind::Embedding,
            SiteKind::Bias,
            SiteKind::LayerNorm,
        ]
        .into_iter()
        .find(|k| k.name() == s)
    }

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
    pub name: String,
    pub param: String,
    pub kind: SiteKind,
    /// Rows of the table, for embeddings.
    pub vocab: Option<usize>,
}
