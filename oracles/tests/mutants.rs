//! Checks that close gaps found by mutation testing of the reference (docs/detection.md,
//! "Mutation testing of the oracle"): behaviour the golden-file and finite-difference tests do
//! not look at.

use ghost_oracle_reference::*;
use ndarray::{array, Array2};

fn tiny(tied: bool) -> Gpt2 {
    let cfg = Gpt2Config::tiny(11, 8, 8, 1, 2);
    Gpt2::random(if tied { cfg } else { cfg.untied() }, 7, 0.5)
}

#[test]
fn reductions_are_named_as_on_the_command_line() {
    assert_eq!(Reduction::Mean.name(), "mean");
    assert_eq!(Reduction::Sum.name(), "sum");
}

#[test]
fn a_head_buffer_of_another_shape_is_replaced_not_written_into() {
    // The buffer a caller reuses may hold a head of another model's shape (V×d here is 11×8);
    // the head gradient must come out as if the buffer were fresh.
    let model = tiny(false);
    let batch = Batch::new(array![[1_i64, 4, 1, 9]], None).unwrap();
    let fresh = example_gradient(&model, &batch, 0, Reduction::Mean, false).unwrap();
    let want = fresh.grad.lm_head.as_ref().expect("a head gradient");
    assert_eq!(want.dim(), (11, 8));
    let mut g = model.zero_gradient();
    g.lm_head = Some(Array2::from_elem((3, 5), 7.0));
    let (loss, _, split) = example_gradient_into(
        &model,
        &batch,
        0,
        Reduction::Mean,
        false,
        HeadPath::Separate,
        &mut g,
    )
    .unwrap();
    assert_eq!(loss, fresh.loss);
    assert_eq!(g.lm_head.as_ref(), Some(want));
    assert_eq!(split, None);
}

/// Example 0's gradient with a tied head folded into the embedding, into `g`: its loss and split.
fn folded_into(model: &Gpt2, batch: &Batch, g: &mut Gpt2Params) -> (f64, Option<SharedSplit>) {
    let (loss, _, split) =
        example_gradient_into(model, batch, 0, Reduction::Mean, false, HeadPath::Folded, g)
            .unwrap();
    (loss, split)
}

#[test]
fn a_folded_head_path_is_the_sum_of_the_separate_paths_and_its_split_their_products() {
    // Repeated ids (1 twice) make the input path's rows sums over positions. The folded buffer
    // must equal input + head path, and its split the two paths' own squared norms and inner
    // product, computed here over the whole separate tables.
    let model = tiny(true);
    let batch = Batch::new(array![[1_i64, 4, 1, 9, 2]], None).unwrap();
    let sep = example_gradient(&model, &batch, 0, Reduction::Mean, false).unwrap();
    let input = &sep.grad.wte;
    let head = sep.grad.lm_head.as_ref().expect("a separate head path");
    let mut g = model.zero_gradient();
    // A stale separate head in the buffer is dropped, not kept beside the folded one.
    g.lm_head = Some(head.clone());
    let (loss, split) = folded_into(&model, &batch, &mut g);
    assert_eq!(loss, sep.loss);
    assert!(g.lm_head.is_none());
    let sum = input + head;
    let scale = sum.iter().fold(0.0_f64, |a, v| a.max(v.abs()));
    for (a, b) in g.wte.iter().zip(sum.iter()) {
        assert!((a - b).abs() <= 1e-14 * scale, "{a} vs {b}");
    }
    let s = split.expect("a tied model's split");
    let dot =
        |a: &Array2<f64>, b: &Array2<f64>| -> f64 { a.iter().zip(b).map(|(x, y)| x * y).sum() };
    let (i2, o2, c) = (dot(input, input), dot(head, head), dot(input, head));
    assert!(
        (s.input_sq - i2).abs() <= 1e-12 * i2,
        "{} vs {i2}",
        s.input_sq
    );
    assert!(
        (s.output_sq - o2).abs() <= 1e-12 * o2,
        "{} vs {o2}",
        s.output_sq
    );
    assert!(
        (s.cross - c).abs() <= 1e-12 * (i2 * o2).sqrt(),
        "{} vs {c}",
        s.cross
    );
    assert!(
        c.abs() > 1e-6 * (i2 * o2).sqrt(),
        "the cross term must matter here"
    );
    // Untied, folding changes nothing: the head is its own parameter.
    let untied = tiny(false);
    let mut g = untied.zero_gradient();
    let (_, split) = folded_into(&untied, &batch, &mut g);
    assert_eq!(split, None);
    let sep = example_gradient(&untied, &batch, 0, Reduction::Mean, false).unwrap();
    assert_eq!(g.lm_head, sep.grad.lm_head);
    assert_eq!(g.wte, sep.grad.wte);
}

fn run(model: &Gpt2, ids: Array2<i64>, reduction: Reduction) -> Reference {
    let opts = Options {
        reduction,
        keep_gradients: true,
        ..Options::default()
    };
    compute(model, &Batch::new(ids, None).unwrap(), &opts, &mut |_| {}).unwrap()
}

#[test]
fn the_layout_lists_every_parameter_once_whatever_the_batch_size() {
    let model = tiny(true);
    for ids in [
        array![[1_i64, 4, 1, 9]],
        array![[1_i64, 4, 1, 9], [2, 2, 3, 0], [5, 6, 7, 8]],
    ] {
        let b = ids.nrows();
        let r = run(&model, ids, Reduction::Mean);
        // One entry per reported parameter, in the order of the per-parameter norms...
        let names: Vec<&str> = r.layout.iter().map(|(n, _)| n.as_str()).collect();
        let reported: Vec<&str> = r.examples[0]
            .params
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(names, reported, "batch of {b}");
        // ...whose sizes add up to every flattened gradient, and whose slices have the norms.
        let g = r.gradients.as_ref().unwrap();
        assert_eq!(g.len(), b);
        let total: usize = r
            .layout
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        for (i, gi) in g.iter().enumerate() {
            assert_eq!(gi.len(), total, "batch of {b}, example {i}");
            let mut offset = 0;
            for ((name, shape), (_, norm)) in r.layout.iter().zip(&r.examples[i].params) {
                let n: usize = shape.iter().product();
                let sq: f64 = gi[offset..offset + n].iter().map(|v| v * v).sum();
                assert!(
                    (sq.sqrt() - norm).abs() <= 1e-12 * norm,
                    "{name}: {} vs {norm}",
                    sq.sqrt()
                );
                offset += n;
            }
        }
    }
}

#[test]
fn the_json_report_carries_every_number_of_the_reference() {
    let model = tiny(true);
    let r = run(
        &model,
        array![[1_i64, 4, 1, 9], [2, 2, 3, 0]],
        Reduction::Sum,
    );
    let j = r.to_json();
    assert_eq!(j["reduction"], "sum");
    let examples = j["examples"].as_array().expect("an examples array");
    assert_eq!(examples.len(), 2);
    for (e, want) in examples.iter().zip(&r.examples) {
        assert_eq!(e["loss"].as_f64(), Some(want.loss));
        assert_eq!(e["norm"].as_f64(), Some(want.norm));
        let params = e["params"].as_object().expect("a params object");
        assert_eq!(params.len(), want.params.len());
        for (name, v) in &want.params {
            assert_eq!(params[name].as_f64(), Some(*v), "{name}");
        }
        assert_eq!(want.shared.len(), 1);
        let (name, split) = &want.shared[0];
        let s = &e["shared"][name];
        assert_eq!(s["input_sq"].as_f64(), Some(split.input_sq));
        assert_eq!(s["output_sq"].as_f64(), Some(split.output_sq));
        assert_eq!(s["cross"].as_f64(), Some(split.cross));
    }
}

#[test]
fn progress_counts_the_examples_done() {
    let model = tiny(false);
    let batch = Batch::new(array![[1_i64, 4, 1, 9], [2, 2, 3, 0], [5, 6, 7, 8]], None).unwrap();
    let mut calls = Vec::new();
    compute(&model, &batch, &Options::default(), &mut |p| {
        if p.pass == 0 {
            calls.push((p.examples_done, p.examples))
        }
    })
    .unwrap();
    assert_eq!(calls, vec![(1, 3), (2, 3), (3, 3)]);
}
