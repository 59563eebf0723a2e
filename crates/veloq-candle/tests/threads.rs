//! Forward passes from several threads at once share rayon's pool, whose other threads a CPU step
//! keeps stealing work for (`Model::forward_step`): every pass finishes, with the very logits it
//! has when it runs alone.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use veloq_candle::config::CacheConfig;
use veloq_candle::model::{Logits, Model};

mod support;

/// The fixture's prompt in two chunks, then token by token: each step's last logits.
fn run(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut caches = CacheConfig::fp16().build(model).unwrap();
    let half = tokens.len() / 2;
    let mut out = Vec::new();
    for chunk in [&tokens[..half], &tokens[half..half + 1]].into_iter().chain(tokens[half + 1..].chunks(1)) {
        let l = model.forward(chunk, &mut caches, Logits::Last).unwrap();
        out.push(l.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    out
}

#[test]
fn steps_from_several_threads_finish_with_their_own_logits() {
    // Two pool threads whatever the machine: one helper per step, as on the 2-core CI.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(2).build_global();
    let (model, tokens, _) = support::fixture::load("gemma3-tiny");
    let alone = run(&model, &tokens);
    let (model, tokens) = (Arc::new(model), Arc::new(tokens));
    let (tx, rx) = mpsc::channel();
    for _ in 0..4 {
        let (model, tokens, tx) = (model.clone(), tokens.clone(), tx.clone());
        std::thread::spawn(move || {
            for _ in 0..8 {
                tx.send(run(&model, &tokens)).unwrap();
            }
        });
    }
    drop(tx);
    for i in 0..32 {
        let got = rx
            .recv_timeout(Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("pass {i} did not finish ({e}): the steps' helpers hold each other"));
        let same = got.iter().flatten().zip(alone.iter().flatten()).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same && got.len() == alone.len(), "pass {i}: logits differ from the pass alone");
    }
}
