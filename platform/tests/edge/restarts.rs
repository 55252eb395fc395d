//! State that survives a restart: pins are restored, and a new base model on an existing data
//! directory leaves the old model's adapters listed as unusable, refused with a clear message.

use serde_json::{Value, json};

use super::common::*;

/// Who pins `name` (the `pinned_by` of the operator's list): tenant ids, `""` for the operator.
fn pinned_by(env: &Env, name: &str) -> Vec<String> {
    let all = env.admin("GET", "/admin/adapters", None).json();
    let row = all["data"].as_array().into_iter().flatten().find(|a| a["name"] == name).cloned().unwrap_or(Value::Null);
    row["pinned_by"].as_array().into_iter().flatten().map(|p| p["tenant_id"].as_str().unwrap_or("").to_string()).collect()
}

#[test]
fn pins_survive_restarts_and_a_new_base_model_makes_the_old_adapters_unusable() {
    for db in databases() {
        let mut env = Env::start(&db, &[]);
        let (acme, key) = env.tenant("acme", json!({}));
        let mut cases = Cases::default();
        let files = adapter_files(2, 53);
        cases.check("upload mine", &env.upload(&key, "mine", &files[0].0, &files[0].1), 201, "\"usable\":true");
        cases.check("upload the operator's", &env.upload(ADMIN, "ops", &files[1].0, &files[1].1), 201, "\"base_model\":\"loraplex-tiny\"");
        cases.check("the tenant loads mine", &env.call(Some(&key), "POST", "/v1/adapters/mine/load", None), 200, "\"held\":true");
        cases.check("the operator pins ops", &env.admin("POST", "/admin/adapters/pin", Some(json!({"name": "ops"}))), 200, "\"held\":true");
        cases.check(
            "the operator pins mine too",
            &env.admin("POST", "/admin/adapters/pin", Some(json!({"tenant_id": acme, "name": "mine"}))),
            200,
            "\"held\":true",
        );

        env.crash_and_restart();
        env.wait_for("the pins to be restored", 60, || pinned_by(&env, "mine").len() == 2 && pinned_by(&env, "ops") == [""]);
        let mut mine = pinned_by(&env, "mine");
        mine.sort();
        cases.ok("after a restart: mine is pinned by the operator and the tenant", mine == ["".to_string(), acme.clone()], format!("{mine:?}"));
        cases.check("the tenant lets its pin go", &env.call(Some(&key), "POST", "/v1/adapters/mine/unload", None), 200, "\"released\":true");
        cases.check(
            "the operator lets its pin of mine go",
            &env.admin("POST", "/admin/adapters/unpin", Some(json!({"tenant_id": acme, "name": "mine"}))),
            200,
            "\"released\":true",
        );
        env.crash_and_restart();
        env.wait_for("the operator's pin of ops to be restored", 60, || pinned_by(&env, "ops") == [""]);
        cases.ok("a pin let go stays gone", pinned_by(&env, "mine").is_empty(), format!("{:?}", pinned_by(&env, "mine")));
        cases.check("served before the change", &env.complete(&key, "mine", 2), 200, "choices");

        // Another base model on the same data directory: the tiny shapes with one key/value head.
        let model = env.dir.path().join("other-model");
        loraplex::synth::synthesize_model(&loraplex::synth::SynthOptions {
            out: model.clone(),
            preset: loraplex::synth::Preset::Tiny,
            seed: 1,
            dtype: loraplex::synth::FileDType::F32,
            kv_heads: Some(1),
        })
        .unwrap();
        let model_arg = model.to_string_lossy().into_owned();
        env.restart_with(&["--model", &model_arg, "--served-model-name", "other-tiny"]);
        let listed = env.call(Some(&key), "GET", "/v1/adapters", None).json();
        let row = listed["data"].as_array().into_iter().flatten().find(|a| a["name"] == "mine").cloned().unwrap_or(Value::Null);
        cases.ok("the tenant's list: mine is not usable", row["usable"] == false, &row);
        let reason = row["unusable_reason"].as_str().unwrap_or_default().to_string();
        cases.ok("the reason names both models", reason.contains("`loraplex-tiny`") && reason.contains("`other-tiny`"), &reason);
        let models = env.call(Some(&key), "GET", "/v1/models", None).text();
        cases.ok("/v1/models lists only the new base model and no old adapter", !models.contains("\"mine\"") && models.contains("other-tiny"), &models);
        let res = env.complete(&key, "mine", 2);
        cases.check("a completion on an old adapter", &res, 400, "upload it again");
        cases.ok("its error names the param", res.json()["error"]["param"] == "model", res.text());
        cases.ok("its error shows no path", !res.text().contains(&*env.data().to_string_lossy()) && !res.text().contains("/adapters/"), res.text());
        cases.check(
            "lorax on an old adapter",
            &env.call(Some(&key), "POST", "/generate", Some(json!({"inputs": "x", "parameters": {"adapter_id": "mine", "max_new_tokens": 1}}))),
            400,
            "\"error_type\":\"validation\"",
        );
        cases.check("loading an old adapter", &env.call(Some(&key), "POST", "/v1/adapters/mine/load", None), 409, "upload it again");
        let all = env.admin("GET", "/admin/adapters", None).text();
        cases.ok("the operator's list marks both unusable", all.matches("\"usable\":false").count() == 2, &all);
        cases.ok("the operator's pin of ops is not restored", pinned_by(&env, "ops").is_empty(), format!("{:?}", pinned_by(&env, "ops")));
        cases.check("the base model serves", &env.complete(&key, "other-tiny", 2), 200, "choices");
        // An adapter for the old model does not fit the new one: its upload is refused.
        cases.check("an old model's adapter is refused at upload", &env.upload(&key, "mine", &files[0].0, &files[0].1), 400, "does not fit");
        let rows = env.query("SELECT base_model, COUNT(*) FROM usage GROUP BY base_model ORDER BY base_model");
        let models: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
        cases.ok("each ledger row names the base model that served it", models == ["loraplex-tiny", "other-tiny"], format!("{rows:?}"));
        cases.finish(&format!("restarts on {}", env.kind()));
    }
}
