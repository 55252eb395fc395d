//! The stack the grammar compiler needs: specifications of every kind of level, just within
//! the depth limit, compile on a thread whose touched stack is measured (Linux: the resident
//! pages of the thread's stack mapping, which a thread never gives back), and must stay a small
//! part of [`COMPILE_STACK`]; just past the limit they are refused before any compile.

use serde_json::{Value, json};

use super::tests::compiler;
use super::*;

/// A chain of `n` definitions, each only a reference to the next.
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("A{i}"), json!({"$ref": format!("#/$defs/A{}", i + 1)}));
    }
    defs.insert(format!("A{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/A0", "$defs": defs})
}

/// A chain of `n` objects, each with a required property that refers to the next.
fn property_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("A{i}"), json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/A{}", i + 1)}}, "required": ["x"]}));
    }
    defs.insert(format!("A{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/A0", "$defs": defs})
}

/// Objects nested `n` deep, without references.
fn nested(n: usize) -> Value {
    let mut v = json!({"type": "integer"});
    for _ in 0..n {
        v = json!({"type": "object", "properties": {"a": v}, "required": ["a"]});
    }
    v
}

/// A Lark grammar of `n` rules (or tokens), each naming the next.
fn lark_chain(n: usize, tokens: bool) -> String {
    let name = |i: usize| if tokens { format!("T{i}") } else { format!("r{i}") };
    let mut g = format!("start: {}\n", name(0));
    for i in 0..n {
        g.push_str(&format!("{}: \"a\" {} | \"b\"\n", name(i), name(i + 1)));
    }
    g.push_str(&format!("{}: \"end\"\n", name(n)));
    g
}

/// Specifications of each kind whose measure is `depth` (or just below it).
fn shapes(depth: usize) -> Vec<(&'static str, GrammarSpec)> {
    vec![
        ("a chain of references", GrammarSpec::json_schema(ref_chain(depth - 3), true)),
        ("a chain of properties by reference", GrammarSpec::json_schema(property_chain((depth - 3) / 3), true)),
        ("nested objects", GrammarSpec::json_schema(nested((depth - 1) / 2), true)),
        ("a chain of rules", GrammarSpec::Lark(lark_chain(depth - 2, false))),
        ("a chain of tokens", GrammarSpec::Lark(lark_chain(depth - 2, true))),
        (
            "a chain of references inside Lark",
            GrammarSpec::Lark(format!("start: \"x\" j\nj: %json {}\n", serde_json::to_string(&ref_chain(depth - 5)).unwrap())),
        ),
    ]
}

/// Runs `f` on a thread with a stack of 512 MiB; what it returns, and the bytes of that
/// stack it touched.
#[cfg(target_os = "linux")]
fn touched_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> (T, usize) {
    std::thread::Builder::new()
        .stack_size(512 << 20)
        .spawn(move || {
            let here = 0u8;
            let address = std::ptr::addr_of!(here) as usize;
            let out = f();
            (out, resident_bytes_of_mapping(address))
        })
        .unwrap()
        .join()
        .unwrap()
}

/// The resident bytes of the memory mapping that holds `address`.
#[cfg(target_os = "linux")]
fn resident_bytes_of_mapping(address: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = a <= address && address < b;
            continue;
        }
        if inside && let Some(kb) = line.strip_prefix("Rss:") {
            return kb.trim().trim_end_matches("kB").trim().parse::<usize>().unwrap() * 1024;
        }
    }
    panic!("no mapping holds {address:#x}")
}

#[cfg(target_os = "linux")]
#[test]
fn a_compile_at_the_depth_limit_touches_a_small_part_of_the_compile_stack() {
    let limit = GrammarLimits::default().max_depth;
    for (name, spec) in shapes(limit) {
        let measured = depth::depth(&spec);
        assert!(measured <= limit && measured + 4 >= limit, "{name}: measured {measured}, built for {limit}");
        let (compiled, touched) = touched_stack(move || compiler().compile(&spec).map(|_| ()));
        compiled.unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!("{name}: depth {measured}, {} kB of stack", touched / 1024);
        // A twelfth: room for a limit raised a few times, and for frames that grow with a newer
        // compiler.
        assert!(touched < COMPILE_STACK / 12, "{name}: {touched} bytes of stack at depth {measured}");
        // And the measure is not far above what the compile needs (about 3.3 kB a level): a
        // level that costs nothing would make the limit refuse what could compile.
        assert!(touched > measured * 1024, "{name}: only {touched} bytes of stack at depth {measured}");
    }
}

#[test]
fn past_the_depth_limit_every_kind_is_refused_before_compiling() {
    let limit = GrammarLimits::default().max_depth;
    for (name, spec) in shapes(limit + 12) {
        let refused = std::thread::Builder::new().stack_size(64 << 20).spawn(move || compiler().compile(&spec).map(|_| ())).unwrap().join().unwrap();
        match refused {
            Err(GrammarError::TooDeep { depth, max, .. }) => assert!(depth > max && max == limit, "{name}: {depth} {max}"),
            other => panic!("{name}: {other:?}"),
        }
    }
}

#[test]
fn a_refusal_for_depth_names_the_limit() {
    let e = GrammarLimits::default().check(&GrammarSpec::json_schema(ref_chain(2000), true)).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("2003 levels deep") && text.contains("at most 1000"), "{text}");
}

/// One definition of a generated specification: what it is, and the two definitions it may
/// name (taken modulo the count).
type Def = (u8, u16, u16);

/// A definition that names `to` definitions later, mostly the next one, so that chains form
/// as well as cycles and fans.
fn target(i: usize, x: u16, n: usize) -> usize {
    match x % 16 {
        0..=13 => (i + 1) % n,
        14 => (i + 1 + (x as usize >> 4) % 7) % n,
        _ => (x as usize >> 4) % n,
    }
}

fn generated_schema(defs: &[Def]) -> Value {
    let n = defs.len();
    let r = |j: usize| json!({"$ref": format!("#/$defs/d{j}")});
    let mut map = serde_json::Map::new();
    for (i, &(kind, a, b)) in defs.iter().enumerate() {
        let (a, b) = (target(i, a, n), target(i, b, n));
        let def = match kind % 32 {
            0..=9 => r(a),
            10..=17 => json!({"type": "object", "properties": {"x": r(a), "y": r(b)}, "required": ["x"]}),
            18..=23 => json!({"anyOf": [r(a), {"type": "integer"}, r(b)]}),
            24..=28 => json!({"type": "array", "items": r(a), "maxItems": 2}),
            29 | 30 => json!({"allOf": [r(a)], "type": "object"}),
            _ => json!({"type": "integer"}),
        };
        map.insert(format!("d{i}"), def);
    }
    json!({"$ref": "#/$defs/d0", "$defs": map})
}

fn generated_lark(defs: &[Def]) -> String {
    let n = defs.len();
    let mut g = String::from("start: d0\n");
    for (i, &(kind, a, b)) in defs.iter().enumerate() {
        let (a, b) = (target(i, a, n), target(i, b, n));
        let body = match kind % 32 {
            0..=7 => format!("d{a}"),
            8..=15 => format!("\"a\" d{a} | \"b\""),
            16..=23 => format!("(\"x\" d{a})? d{b} \"y\""),
            24..=30 => format!("\"[\" (d{a} (\",\" d{b})*)? \"]\""),
            _ => "/[0-9]+/".to_string(),
        };
        g.push_str(&format!("d{i}: {body}\n"));
    }
    g
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 40, ..Default::default() })]

    /// Generated schemas and grammars of chains, cycles and fans of up to 1,500 definitions:
    /// each compiles or is refused with an error (never a panic or an overflow), and one the
    /// depth check lets through touches under a twelfth of the compile stack.
    #[test]
    fn generated_specifications_compile_or_are_refused_within_the_stack(
        defs in proptest::collection::vec((0u8..32, proptest::prelude::any::<u16>(), proptest::prelude::any::<u16>()), 1..1500),
        lark in proptest::prelude::any::<bool>(),
    ) {
        let spec = if lark { GrammarSpec::Lark(generated_lark(&defs)) } else { GrammarSpec::json_schema(generated_schema(&defs), false) };
        let admitted = GrammarLimits::default().check(&spec).is_ok();
        let run = move || compiler().compile(&spec).map(|_| ());
        #[cfg(target_os = "linux")]
        let (result, touched) = touched_stack(run);
        #[cfg(not(target_os = "linux"))]
        let (result, touched) = (std::thread::Builder::new().stack_size(COMPILE_STACK).spawn(run).unwrap().join().unwrap(), 0);
        if admitted {
            proptest::prop_assert!(touched < COMPILE_STACK / 12, "{touched} bytes of stack");
        } else {
            proptest::prop_assert!(matches!(result, Err(GrammarError::TooDeep { .. })), "{result:?}");
        }
    }
}
