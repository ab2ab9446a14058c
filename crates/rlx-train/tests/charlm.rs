//! The character GPT job on a small corpus and a small model: the corpus split by
//! file, training lowers the loss, the validation loss and the sample come back, and
//! bad settings are errors.

use rlx_train::jobs::{CharCorpus, CharLmConfig, train_charlm};
use std::path::PathBuf;

fn corpus_dir(files: usize) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rlx-charlm-{}-{files}", std::process::id()));
    std::fs::create_dir_all(dir.join("pkg")).unwrap();
    std::fs::create_dir_all(dir.join("site-packages")).unwrap();
    for i in 0..files {
        let text = format!(
            "def f{i}(x):\n    return x + {i}\n\nclass C{i}:\n    def m(self):\n        return f{i}(self)\n"
        );
        let sub = if i % 2 == 0 { "pkg" } else { "" };
        std::fs::write(dir.join(sub).join(format!("m{i}.py")), text.repeat(20)).unwrap();
    }
    // Not read: another suffix, and site-packages.
    std::fs::write(dir.join("notes.txt"), "not python").unwrap();
    std::fs::write(dir.join("site-packages").join("x.py"), "skipped = True\n").unwrap();
    dir
}

fn tiny() -> CharLmConfig {
    CharLmConfig {
        layers: 1,
        width: 32,
        heads: 2,
        context: 16,
        batch: 8,
        steps: 60,
        lr: 1e-2,
        val_batches: 2,
        sample_bytes: 20,
        ..CharLmConfig::default()
    }
}

#[test]
fn a_small_gpt_learns_its_corpus() {
    let dir = corpus_dir(20);
    let corpus = CharCorpus::from_dir(&dir).unwrap();
    assert_eq!(corpus.files, (18, 2));
    assert!(!corpus.train.windows(7).any(|w| w == b"skipped"));
    let (trainer, report) = train_charlm(&corpus, &tiny(), &mut |_| {}).unwrap();
    assert_eq!(trainer.steps(), 60);
    let first = report.losses[..5].iter().sum::<f32>() / 5.0;
    let last = report.losses[55..].iter().sum::<f32>() / 5.0;
    assert!(
        last < first * 0.6,
        "the loss fell from {first} to {last} only"
    );
    let val = report.metric("val_loss").unwrap();
    assert!(
        val.is_finite() && val < first as f64,
        "validation loss {val}"
    );
    let sample = &report.texts[0].1;
    assert!(
        sample.starts_with("def ") && sample.len() >= 20,
        "{sample:?}"
    );

    // Dropout trains too, and stopping early keeps the schedule of the whole run.
    let config = CharLmConfig {
        dropout: 0.1,
        stop_after: Some(10),
        ..tiny()
    };
    let (trainer, report) = train_charlm(&corpus, &config, &mut |_| {}).unwrap();
    assert_eq!((trainer.steps(), report.losses.len()), (10, 10));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_corpora_and_settings_are_errors() {
    let few = corpus_dir(5);
    let err = CharCorpus::from_dir(&few).unwrap_err().to_string();
    assert!(err.contains("only 5 .py files"), "{err}");
    assert!(CharCorpus::from_dir(&few.join("absent")).is_err());
    std::fs::remove_dir_all(&few).ok();

    let dir = corpus_dir(12);
    let corpus = CharCorpus::from_dir(&dir).unwrap();
    let bad = [
        CharLmConfig {
            width: 30,
            heads: 4,
            ..tiny()
        },
        CharLmConfig {
            dropout: 1.0,
            ..tiny()
        },
        CharLmConfig {
            context: 0,
            ..tiny()
        },
        CharLmConfig {
            fixed_batches: Some(vec![b'a'; 10]),
            ..tiny()
        },
    ];
    for config in bad {
        assert!(
            train_charlm(&corpus, &config, &mut |_| {}).is_err(),
            "{config:?}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
