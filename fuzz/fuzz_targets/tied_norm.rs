//! Tied norm math on arbitrary shapes, values and ids, the embedding and the head each on rows of
//! its own: exact tied ghost clipping in f64 agrees with the reference's materialization within
//! the derived bound, or the input is refused with
//! an error (ids outside the table); never a panic.
#![no_main]

use arbitrary::Arbitrary;
use candle_core::{DType, Device};
use ghost_oracle::audit::claim_of;
use ghost_oracle::{ClipNorm, Clipper, Judge, NoiseMultiplier, Precision, TiedGhostClipper, Trace, Verdict};
use ghost_oracle_reference::{Site, SiteKind, SiteSpec, Trace as RefTrace};
use libfuzzer_sys::fuzz_target;
use ndarray::{Array2, Array3};

#[derive(Arbitrary, Debug)]
struct Input {
    batch: u8,
    seq: u8,
    width: u8,
    vocab: u8,
    ids: Vec<u8>,
    values: Vec<i16>,
    exponents: Vec<i8>,
}

fuzz_target!(|inp: Input| {
    let (b, t, d, v) = (
        inp.batch as usize % 3 + 1,
        inp.seq as usize % 6 + 1,
        inp.width as usize % 4 + 1,
        inp.vocab as usize % 7 + 1,
    );
    // Values: arbitrary mantissas times powers of ten over ±12 decades (finite by construction).
    let mut k = 0usize;
    let mut next = || {
        let m = *inp.values.get(k % inp.values.len().max(1)).unwrap_or(&1) as f64 / 1024.0;
        let e = *inp.exponents.get(k % inp.exponents.len().max(1)).unwrap_or(&0) as i32 % 13;
        k += 1;
        m * 10f64.powi(e)
    };
    // The head has rows of its own (a pooled head: 1; a head on every token: T), from the bits of
    // `seq` that T does not read.
    let head_rows = inp.seq as usize / 6 % 6 + 1;
    let e = Array3::from_shape_fn((b, t, d), |_| next());
    let h = Array3::from_shape_fn((b, head_rows, d), |_| next());
    let delta = Array3::from_shape_fn((b, head_rows, v), |_| next());
    // Ids may fall outside the table: the trace must then be refused, not mis-read.
    let ids = Array2::from_shape_fn((b, t), |(i, j)| *inp.ids.get(i * t + j).unwrap_or(&0) as i64 % (v as i64 + 1));
    let rt = RefTrace {
        sites: vec![
            Site { spec: SiteSpec { name: "emb".into(), param: "w".into(), kind: SiteKind::Embedding, vocab: Some(v) }, activations: None, ids: Some(ids), backprops: e, conv: None },
            Site { spec: SiteSpec { name: "head".into(), param: "w".into(), kind: SiteKind::Linear, vocab: None }, activations: Some(h), ids: None, backprops: delta, conv: None },
        ],
    };
    let out_of_table = rt.sites[0].ids.as_ref().unwrap().iter().any(|&x| x >= v as i64);
    // The only input a trace may be refused for here: an id outside the table, named as such.
    let trace = match Trace::from_reference(&rt, DType::F64, &Device::Cpu) {
        Ok(trace) => {
            assert!(!out_of_table, "an id outside the table was accepted");
            trace
        }
        Err(e) => {
            assert!(out_of_table && e.to_string().contains("outside the table"), "unexpected refusal: {e}");
            return;
        }
    };
    // Values span ±12 decades, so a squared norm can overflow f64: that, and only that, is
    // refused by the truth.
    let judge = match Judge::from_trace(rt) {
        Ok(judge) => judge,
        Err(e) => {
            assert!(e.to_string().contains("overflows f64"), "unexpected refusal: {e}");
            return;
        }
    };
    let truth = &judge.truth;
    if truth.norms.iter().any(|n| *n == 0.0 || !n.is_finite()) {
        return;
    }
    let c = ClipNorm::new(truth.norms[0]).expect("a positive, finite norm");
    let clipped = TiedGhostClipper.clip(&trace, c).expect("clipping a valid trace");
    let claim = claim_of(clipped).expect("f64 claim");
    let m = judge.evaluate("fuzz", &claim, c, NoiseMultiplier::ONE, Precision::F64).expect("evaluate");
    match m.verdict {
        Verdict::Pass => {}
        // Cancellation so deep (a tied norm of 2e-13 from values of 1e-7, say) that the derived
        // bound is past what the judge calls judgeable: an honest refusal, but only where the
        // clipper's norm still sits within every example's bound.
        Verdict::CannotJudge => assert!(
            m.examples.iter().all(|e| e.norm_rel_err <= e.bound) && !m.unjudgeable_examples.is_empty(),
            "{:?}",
            m.examples[m.worst_example]
        ),
        other => panic!("{other:?}: {:?}", m.examples[m.worst_example]),
    }
});
