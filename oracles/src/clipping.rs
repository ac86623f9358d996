//! How DP-SGD forms a clipping coefficient from an example's gradient norm: flat clipping, the
//! rule of DP-SGD as published (Abadi et al.), or automatic clipping (normalization, fastDP's
//! default). A rule of the privacy mechanism, shared by the trace a library writes and the
//! judge that recomputes the true coefficients.

/// How a clipping coefficient is formed from a norm n: flat clipping min(1, C/(n + γ)), or
/// automatic clipping C/(n + γ) (fastDP's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clipping {
    /// min(1, C/(n + γ)): examples within the bound are left as they are.
    Flat,
    /// C/(n + γ): every example is rescaled to norm about C.
    Automatic,
}

impl Clipping {
    /// `flat` or `automatic`, as a trace's `__metadata__.clipping` names it.
    pub fn name(self) -> &'static str {
        match self {
            Clipping::Flat => "flat",
            Clipping::Automatic => "automatic",
        }
    }

    /// The rule a name gives, `None` for any other text.
    pub fn parse(s: &str) -> Option<Self> {
        [Clipping::Flat, Clipping::Automatic]
            .into_iter()
            .find(|c| c.name() == s)
    }

    /// The coefficient of a norm n at clipping norm C and stabilizer γ.
    pub fn coefficient(self, norm: f64, max_grad_norm: f64, stabilizer: f64) -> f64 {
        let c = max_grad_norm / (norm + stabilizer);
        match self {
            Clipping::Flat => c.min(1.0),
            Clipping::Automatic => c,
        }
    }
}
