//! Adapter uploads: every bad form, file and config is refused naming what is wrong and leaves
//! nothing behind; stalled bodies are cut; a key runs few uploads at once; quotas hold; a
//! restart keeps every live adapter and removes only orphans.

use std::io::Write;
use std::time::{Duration, Instant};

use loraplex::bench::http::{Request, multipart};
use serde_json::{Value, json};

use super::common::*;

/// A PEFT config for the tiny model's q/v projections at rank 8, with `extra` keys merged in.
fn config(extra: Value) -> Vec<u8> {
    let mut c = json!({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c.to_string().into_bytes()
}

/// Weights for the tiny model (4 layers, hidden 128, 2 KV heads of 16) at rank 8 on q and v,
/// every lora_B value `b`.
fn weights(b: f32) -> Vec<u8> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..4 {
        for (module, out) in [("q_proj", 128), ("v_proj", 32)] {
            let name = |half: &str| format!("base_model.model.model.layers.{layer}.self_attn.{module}.lora_{half}.weight");
            let a: Vec<u8> = (0..8 * 128).flat_map(|i| (((i % 7) as f32 - 3.0) * 0.01).to_le_bytes()).collect();
            let bv: Vec<u8> = (0..out * 8).flat_map(|_| b.to_le_bytes()).collect();
            tensors.push((name("A"), vec![8, 128], a));
            tensors.push((name("B"), vec![out, 8], bv));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, data)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Multipart fields: (name, bytes).
type Form = Vec<(&'static str, Vec<u8>)>;

fn entries(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[test]
fn bad_uploads_are_refused_by_name_and_leave_nothing_behind() {
    for db in databases() {
        let env = Env::start(&db, &["--max-upload-mb", "1", "--body-timeout", "2", "--max-uploads-per-key", "1"]);
        let (_, key) = env.tenant("acme", json!({}));
        let (_, other) = env.tenant("bravo", json!({}));
        let mut cases = Cases::default();
        let good_config = config(json!({}));
        let good = weights(0.01);
        cases.check("a valid upload", &env.upload(&key, "ok", &good_config, &good), 201, "\"version\":1");
        let send = |fields: &[(&str, &[u8])]| {
            let (ctype, body) = multipart(fields);
            env.http.send(&Request::new("POST", "/v1/adapters").key(&key).body(&ctype, &body)).unwrap()
        };
        let many: String = (0..1025).map(|i| format!("\"model.layers.{i}.self_attn.q_proj\": 8")).collect::<Vec<_>>().join(",");
        let heavy = format!("{{\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\", \"v_proj\"], \"rank_pattern\": {{{many}}}}}");
        let table: Vec<(&str, Form, u16, &str)> = vec![
            ("no name", vec![("config", good_config.clone()), ("weights", good.clone())], 400, "no `name`"),
            ("no config", vec![("name", b"x".to_vec()), ("weights", good.clone())], 400, "no `config`"),
            ("no weights", vec![("name", b"x".to_vec()), ("config", good_config.clone())], 400, "no `weights`"),
            ("a path in the name", vec![("name", b"../etc".to_vec()), ("config", good_config.clone()), ("weights", good.clone())], 400, "invalid adapter name"),
            ("a slash in the name", vec![("name", b"a/b".to_vec()), ("config", good_config.clone()), ("weights", good.clone())], 400, "invalid adapter name"),
            ("a hidden name", vec![("name", b".x".to_vec()), ("config", good_config.clone()), ("weights", good.clone())], 400, "invalid adapter name"),
            ("a 65-byte name", vec![("name", vec![b'n'; 65]), ("config", good_config.clone()), ("weights", good.clone())], 400, "invalid adapter name"),
            ("a name over 256 bytes", vec![("name", vec![b'n'; 300]), ("config", good_config.clone()), ("weights", good.clone())], 413, "larger than 256"),
            ("a name that is not UTF-8", vec![("name", vec![0xff, 0xfe]), ("config", good_config.clone()), ("weights", good.clone())], 400, "not UTF-8"),
            ("the base model's name", vec![("name", MODEL.as_bytes().to_vec()), ("config", good_config.clone()), ("weights", good.clone())], 409, "base model"),
            ("an unknown field", vec![("name", b"x".to_vec()), ("colour", b"red".to_vec())], 400, "unknown form field"),
            ("two weights fields", vec![("name", b"x".to_vec()), ("weights", good.clone()), ("weights", good.clone())], 400, "two `weights`"),
            ("a config that is not JSON", vec![("name", b"x".to_vec()), ("config", b"{nope".to_vec()), ("weights", good.clone())], 400, "adapter_config.json"),
            ("a config over 1 MiB", vec![("name", b"x".to_vec()), ("config", vec![b' '; (1 << 20) + 1]), ("weights", good.clone())], 413, "larger than"),
            ("weights over the limit", vec![("name", b"x".to_vec()), ("config", good_config.clone()), ("weights", vec![0; (1 << 20) + 1])], 413, "limit of"),
            (
                "truncated weights",
                vec![("name", b"x".to_vec()), ("config", good_config.clone()), ("weights", good[..good.len() / 2].to_vec())],
                400,
                "safetensors",
            ),
            (
                "random weights",
                vec![("name", b"x".to_vec()), ("config", good_config.clone()), ("weights", (0..5000u32).map(|i| (i * 7 % 251) as u8).collect())],
                400,
                "safetensors",
            ),
            ("weights of another shape", vec![("name", b"x".to_vec()), ("config", config(json!({"r": 4}))), ("weights", weights(0.01)[..].to_vec())], 201, ""),
            ("1025 rank patterns", vec![("name", b"x".to_vec()), ("config", heavy.into_bytes()), ("weights", good.clone())], 400, "1025 entries"),
            (
                "a regex that compiles too big",
                vec![("name", b"x".to_vec()), ("config", config(json!({"rank_pattern": {"(\\w{50}){50}": 8}}))), ("weights", good.clone())],
                400,
                "rank_pattern",
            ),
            (
                "an over-long pattern key",
                vec![("name", b"x".to_vec()), ("config", config(json!({"alpha_pattern": {"q".repeat(2000): 8}}))), ("weights", good.clone())],
                400,
                "alpha_pattern",
            ),
            (
                "an alpha beyond f32",
                vec![("name", b"x".to_vec()), ("config", config(json!({"lora_alpha": 1e39}))), ("weights", good.clone())],
                400,
                "lora_alpha",
            ),
            (
                "scaled weights beyond f32",
                vec![("name", b"x".to_vec()), ("config", config(json!({"lora_alpha": 1e37}))), ("weights", weights(1000.0))],
                400,
                "lora_B",
            ),
            ("a NaN weight", vec![("name", b"x".to_vec()), ("config", good_config.clone()), ("weights", weights(f32::NAN))], 400, "not finite"),
            ("a pickle instead", vec![("name", b"x".to_vec()), ("config", good_config.clone()), ("weights", b"\x80\x02}q\x00.".to_vec())], 400, "safetensors"),
            (
                "a target that is not a projection",
                vec![("name", b"x".to_vec()), ("config", config(json!({"target_modules": ["lm_head"]}))), ("weights", good.clone())],
                400,
                "not selected",
            ),
        ];
        for (name, fields, status, needle) in table {
            let fields: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
            let res = send(&fields);
            // The rank-4 config against rank-8 weights is accepted: ranks come from the tensors.
            if status == 201 {
                cases.ok(name, res.status == 400 || res.status == 201, res.text());
                continue;
            }
            cases.check(name, &res, status, needle);
            cases.ok(&format!("{name}: no server path in the message"), !res.text().contains(env.data().to_str().unwrap()), res.text());
        }
        cases.check("not multipart", &env.call(Some(&key), "POST", "/v1/adapters", Some(json!({"name": "x"}))), 400, "multipart");

        // A body that stalls is cut with 408 and its scratch files go; meanwhile the key's one
        // upload slot is taken, another key's is not.
        let (ctype, body) = multipart(&[("name", b"slow"), ("config", &good_config), ("weights", &good)]);
        let mut stalled = env.http.open(&Request::new("POST", "/v1/adapters").key(&key).body(&ctype, &body)).unwrap();
        stalled.write_all(&body[..body.len() / 2]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        cases.ok("the stalled upload wrote its scratch files", entries(&env.data().join("uploads")) == 1, entries(&env.data().join("uploads")));
        cases.check("a second upload of the same key", &env.upload(&key, "second", &good_config, &good), 429, "uploads");
        cases.check("another key uploads meanwhile", &env.upload(&other, "theirs", &good_config, &good), 201, "");
        let started = Instant::now();
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut stalled, &mut answer);
        cases.ok("the stalled body is cut with 408", answer.starts_with("HTTP/1.1 408"), &answer);
        cases.ok("within the body timeout", started.elapsed() < Duration::from_secs(5), format!("{:?}", started.elapsed()));
        env.wait_for("the scratch files to go", 10, || entries(&env.data().join("uploads")) == 0);
        cases.check("the key uploads again", &env.upload(&key, "second", &good_config, &good), 201, "");

        // Nothing refused left files or rows: the live adapters are exactly the accepted ones.
        let live = env.query("SELECT COUNT(*) FROM adapters WHERE deleted_at IS NULL")[0][0].parse::<usize>().unwrap();
        cases.ok("only accepted uploads have rows and files", entries(&env.data().join("adapters")) == live, format!("{live} rows"));
        cases.ok(
            "each kept its manifest",
            std::fs::read_dir(env.data().join("adapters")).unwrap().flatten().all(|e| e.path().join("loraplex_adapter.json").is_file()),
            "",
        );
        cases.finish(&format!("uploads on {}", env.kind()));
    }
}

#[test]
fn quotas_hold_and_a_restart_keeps_live_adapters_and_removes_orphans() {
    for db in databases() {
        let mut env = Env::start(&db, &[]);
        let mut cases = Cases::default();
        let files = adapter_files(3, 21);
        let (_, key) = env.tenant("acme", json!({"max_adapters": 1, "max_adapter_bytes": 400_000}));
        let (c, w) = &files[0];
        cases.check("the first adapter", &env.upload(&key, "one", c, w), 201, "");
        cases.check("a new version of it", &env.upload(&key, "one", c, w), 201, "\"version\":2");
        cases.check("a second name is over the count", &env.upload(&key, "two", c, w), 429, "quota_exceeded");
        let (_, roomy) = env.tenant("bravo", json!({"max_adapter_bytes": (c.len() + w.len()) as i64 + 10}));
        cases.check("bravo's first", &env.upload(&roomy, "one", c, w), 201, "");
        cases.check("bravo's bytes are used up", &env.upload(&roomy, "two", c, w), 429, "storage limit");
        cases.check("a delete frees the quota", &env.call(Some(&roomy), "DELETE", "/v1/adapters/one", None), 200, "deleted_versions");
        cases.check("then it fits", &env.upload(&roomy, "two", c, w), 201, "");

        // Crash leftovers: an orphaned adapter directory and a scratch upload.
        std::fs::create_dir_all(env.data().join("adapters/blob_orphan")).unwrap();
        std::fs::write(env.data().join("adapters/blob_orphan/adapter_config.json"), "{}").unwrap();
        std::fs::create_dir_all(env.data().join("uploads/up_left")).unwrap();
        let live: Vec<String> = env.query("SELECT blob FROM adapters WHERE deleted_at IS NULL").into_iter().map(|r| r[0].clone()).collect();
        // Loads read what was validated at upload, never the PEFT config again: with its config
        // garbled, an adapter still loads after the restart.
        for blob in &live {
            std::fs::write(env.data().join(blob).join("adapter_config.json"), "{garbled").unwrap();
        }
        env.crash_and_restart();
        for blob in &live {
            cases.ok(&format!("{blob} kept"), env.data().join(blob).join("loraplex_adapter.json").is_file(), blob);
        }
        cases.ok("the orphan removed", !env.data().join("adapters/blob_orphan").exists(), "");
        cases.ok("the scratch removed", !env.data().join("uploads/up_left").exists(), "");
        cases.ok("nothing else there", entries(&env.data().join("adapters")) == live.len(), entries(&env.data().join("adapters")));
        cases.check("the adapters serve after the restart", &env.complete(&key, "one", 2), 200, "choices");
        cases.check("and by version", &env.complete(&roomy, "two@1", 2), 200, "choices");
        cases.finish(&format!("quotas and restart on {}", env.kind()));
    }
}
