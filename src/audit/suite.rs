//! The built-in suite: seeded models and batches of every family, no files.

use super::Case;
use ghost_oracle_reference::{
    Batch, Gpt2, Gpt2Config, Llama, LlamaConfig, LlamaFlavor, Model, SplitMix64, IGNORE,
};
use ndarray::Array2;

/// The decoder-only family of a built-in case.
#[derive(Clone, Copy)]
enum Family {
    Gpt2,
    /// A Llama-shaped family (Llama, Qwen2, Qwen3, Gemma 3, ...) with this many key/value heads
    /// (grouped-query attention when fewer than the query heads).
    Llama(LlamaFlavor, usize),
}

/// A built-in model: its name, family and shape; [`ModelSpec::on`] gives it its batch.
#[derive(Clone, Copy)]
struct ModelSpec {
    name: &'static str,
    family: Family,
    vocab: usize,
    d: usize,
    layers: usize,
    heads: usize,
}

/// `name`: a `family` model of `vocab` tokens, width `d`, `layers` blocks of `heads` heads.
const fn model(
    name: &'static str,
    family: Family,
    vocab: usize,
    d: usize,
    layers: usize,
    heads: usize,
) -> ModelSpec {
    ModelSpec {
        name,
        family,
        vocab,
        d,
        layers,
        heads,
    }
}

impl ModelSpec {
    /// The case of this model on `batch` sequences of `seq` tokens: tied, ids from the whole
    /// vocabulary, every label kept, weights N(0, 0.5²); the methods of [`CaseSpec`] change one
    /// of these.
    const fn on(self, batch: usize, seq: usize) -> CaseSpec {
        CaseSpec {
            model: self,
            tied: true,
            batch,
            seq,
            id_range: self.vocab,
            ignore: 0.0,
            init_std: 0.5,
        }
    }
}

struct CaseSpec {
    model: ModelSpec,
    tied: bool,
    batch: usize,
    seq: usize,
    /// Ids drawn from 0..id_range (small: many repeated tokens).
    id_range: usize,
    /// The chance that a label from position 2 on is ignored.
    ignore: f64,
    init_std: f64,
}

impl CaseSpec {
    /// The LM head its own parameter.
    const fn untied(self) -> Self {
        CaseSpec {
            tied: false,
            ..self
        }
    }

    /// Ids from 0..id_range only: fewer distinct tokens, more repeats.
    const fn ids_below(self, id_range: usize) -> Self {
        CaseSpec { id_range, ..self }
    }

    /// Each label from position 2 on ignored with this chance.
    const fn ignoring(self, ignore: f64) -> Self {
        CaseSpec { ignore, ..self }
    }

    /// Weights N(0, init_std²).
    const fn init_std(self, init_std: f64) -> Self {
        CaseSpec { init_std, ..self }
    }
}

const GPT2: Family = Family::Gpt2;
const LLAMA_GQA: Family = Family::Llama(LlamaFlavor::Llama, 2);
const QWEN2_GQA: Family = Family::Llama(LlamaFlavor::Qwen2, 2);
const QWEN3_GQA: Family = Family::Llama(LlamaFlavor::Qwen3, 2);
const GEMMA3_GQA: Family = Family::Llama(LlamaFlavor::Gemma3Text, 2);

/// `model(name, family, vocab, d, layers, heads).on(batch, seq)`, then what differs.
const SUITE: &[CaseSpec] = &[
    model("tied-T2", GPT2, 29, 16, 1, 2).on(6, 2),
    model("tied-T16-repeats", GPT2, 29, 16, 2, 4)
        .on(6, 16)
        .ids_below(5),
    model("tied-T24-ignored", GPT2, 31, 16, 2, 2)
        .on(6, 24)
        .ids_below(12)
        .ignoring(0.3),
    model("tied-T64", GPT2, 61, 24, 2, 3)
        .on(4, 64)
        .init_std(0.4),
    model("tied-T32-vocab257", GPT2, 257, 32, 1, 4)
        .on(4, 32)
        .ids_below(40)
        .init_std(0.4),
    model("tied-T8-strong-cross", GPT2, 17, 8, 1, 2)
        .on(8, 8)
        .ids_below(6)
        .init_std(1.0),
    model("untied-T16", GPT2, 29, 16, 2, 4)
        .on(6, 16)
        .untied()
        .ids_below(8),
    model("untied-T64", GPT2, 61, 24, 2, 3)
        .on(4, 64)
        .untied()
        .ignoring(0.1)
        .init_std(0.4),
    model("llama-tied-gqa-T24", LLAMA_GQA, 37, 16, 2, 4)
        .on(4, 24)
        .ids_below(12)
        .ignoring(0.1),
    model("qwen2-tied-biases-T16", QWEN2_GQA, 31, 16, 1, 4)
        .on(4, 16)
        .ids_below(10)
        .init_std(0.6),
    model("qwen3-tied-qk-T16", QWEN3_GQA, 31, 16, 1, 4)
        .on(4, 16)
        .ids_below(10)
        .init_std(0.6),
    model("gemma3-tied-swa-T24", GEMMA3_GQA, 37, 16, 2, 4)
        .on(4, 24)
        .ids_below(12)
        .ignoring(0.1)
        .init_std(0.2),
];

/// C as multiples of the median true norm: most examples clipped, about half, almost none.
pub const SUITE_C_MULTIPLIERS: [f64; 3] = [0.5, 1.0, 2.0];

/// The built-in suite: seeded GPT-2, Llama, Qwen2, Qwen3 and Gemma 3 models and batches, no
/// files. Sequence length 1 is absent because a causal LM has no target there (the property
/// tests cover T = 1 sites).
pub fn builtin_suite() -> Vec<Case> {
    SUITE
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let seed = 1000 + k as u64;
            Case {
                name: s.model.name.to_string(),
                model: s.model(seed),
                batch: s.batch(seed),
                c_multipliers: SUITE_C_MULTIPLIERS.to_vec(),
            }
        })
        .collect()
}

impl CaseSpec {
    /// The case's seeded model.
    fn model(&self, seed: u64) -> Model {
        let m = &self.model;
        match m.family {
            Family::Gpt2 => {
                let mut cfg = Gpt2Config::tiny(m.vocab, self.seq.max(8), m.d, m.layers, m.heads);
                cfg.tie_word_embeddings = self.tied;
                Gpt2::random(cfg, seed, self.init_std).into()
            }
            Family::Llama(flavor, kv_heads) => {
                let mut cfg = LlamaConfig::tiny(flavor, m.vocab, m.d, m.layers, m.heads, kv_heads);
                cfg.tie_word_embeddings = self.tied;
                if flavor.is_gemma() {
                    // A window shorter than the sequence and a final soft-cap, both active.
                    cfg.sliding_window = Some(self.seq / 3);
                    cfg.final_logit_softcapping = Some(10.0);
                }
                if flavor.head_norms() {
                    // `attention_bias` on, so that a wrong bias norm has a bias to get wrong.
                    cfg.attention_bias = true;
                }
                Llama::random(cfg, seed, self.init_std).into()
            }
        }
    }

    /// The case's seeded batch: ids from 0..id_range, labels the ids with each from position 2
    /// on ignored with chance `ignore`.
    fn batch(&self, seed: u64) -> Batch {
        let mut rng = SplitMix64::new(seed ^ 0xBA7C);
        let ids =
            Array2::from_shape_fn((self.batch, self.seq), |_| rng.below(self.id_range) as i64);
        let mut labels = ids.clone();
        for i in 0..self.batch {
            for t in 2..self.seq {
                if rng.uniform() < self.ignore {
                    labels[(i, t)] = IGNORE;
                }
            }
        }
        Batch::new(ids, Some(labels)).expect("a built-in batch is valid")
    }
}
