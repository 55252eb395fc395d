//! How deep a specification makes the grammar compiler recurse, measured before it compiles.
//!
//! llguidance compiles recursively: a JSON schema's subschemas and every `$ref` it follows, a
//! Lark grammar's rules and tokens through the rules and tokens they name. A chain of a few
//! hundred `$ref`s or rules is a small body and a deep stack; past the thread's stack the process
//! aborts, with every tenant's streams. So each specification's depth is bounded first, by a
//! measure that is never below the recursion the compiler can reach:
//!
//! - the specification is a graph: for a schema, every object and array of its JSON is a node,
//!   with edges to the values inside it and from each `$ref` to every place the reference can
//!   name; for Lark, every rule and token is a node, with edges to the names its body uses;
//! - the compiler's stack at any moment is a simple path through that graph (it never enters a
//!   definition it is already inside), and a simple path spends at most all of a strongly
//!   connected component's nodes before it leaves it for good;
//! - so the depth is the heaviest path through the graph's components, each weighing the sum of
//!   its nodes. A recursive schema (a tree whose nodes refer to the tree) weighs the few nodes of
//!   its cycle, not the depth of any text it matches.
//!
//! The measure is linear in the specification's size and runs without recursion itself (every
//! walk keeps its own stack), so the check cannot overflow the stack it protects.

use std::collections::HashMap;

use serde_json::Value;

use super::GrammarSpec;

/// The measure of `spec` (see the module's documentation).
pub(crate) fn depth(spec: &GrammarSpec) -> usize {
    match spec {
        GrammarSpec::JsonSchema(schema) => json_schema_depth(schema),
        GrammarSpec::JsonObject | GrammarSpec::Choice(_) => 1,
        GrammarSpec::Regex(rx) => regex_depth(rx),
        GrammarSpec::Lark(text) | GrammarSpec::Tools(text) => lark_depth(text),
    }
}

/// A directed graph whose nodes have weights.
#[derive(Default)]
struct Graph {
    weight: Vec<usize>,
    edges: Vec<Vec<usize>>,
}

impl Graph {
    fn node(&mut self, weight: usize) -> usize {
        self.weight.push(weight);
        self.edges.push(Vec::new());
        self.weight.len() - 1
    }

    fn edge(&mut self, from: usize, to: usize) {
        self.edges[from].push(to);
    }

    /// The weight of the heaviest path through the strongly connected components, each
    /// weighing the sum of its nodes (Tarjan's algorithm, iteratively; it closes each component
    /// after every component it reaches, so their weights are known by then).
    fn heaviest_path(&self) -> usize {
        const NONE: usize = usize::MAX;
        let n = self.weight.len();
        let (mut index, mut low, mut component) = (vec![NONE; n], vec![0; n], vec![NONE; n]);
        let mut on_stack = vec![false; n];
        let (mut stack, mut best): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        let mut next = 0;
        let mut heaviest = 0;
        for root in 0..n {
            if index[root] != NONE {
                continue;
            }
            // (node, the next of its edges to follow)
            let mut calls = vec![(root, 0usize)];
            index[root] = next;
            low[root] = next;
            next += 1;
            stack.push(root);
            on_stack[root] = true;
            while let Some(&mut (v, ref mut e)) = calls.last_mut() {
                if let Some(&w) = self.edges[v].get(*e) {
                    *e += 1;
                    if index[w] == NONE {
                        index[w] = next;
                        low[w] = next;
                        next += 1;
                        stack.push(w);
                        on_stack[w] = true;
                        calls.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                calls.pop();
                if let Some(&(parent, _)) = calls.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] != index[v] {
                    continue;
                }
                // v closes a component: its members are on the stack down to v.
                let id = best.len();
                let mut members = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component[w] = id;
                    members.push(w);
                    if w == v {
                        break;
                    }
                }
                let own: usize = members.iter().map(|&m| self.weight[m]).fold(0, usize::saturating_add);
                let after = members.iter().flat_map(|&m| &self.edges[m]).filter(|&&w| component[w] != id).map(|&w| best[component[w]]).max().unwrap_or(0);
                let total = own.saturating_add(after);
                best.push(total);
                heaviest = heaviest.max(total);
            }
        }
        heaviest
    }
}

/// The objects of a JSON document that references can name by more than a pointer from the
/// root: those with an `$id` (pointers may be relative to them) or an anchor.
#[derive(Default)]
struct Names<'a> {
    /// The objects with an `$id`, by its last path segment (without its fragment).
    ids: HashMap<&'a str, Vec<&'a Value>>,
    anchors: HashMap<&'a str, Vec<&'a Value>>,
}

/// The most places the references of one schema may be looked up in: past it (only a document
/// built to be slow to measure gets there, with thousands of objects sharing one `$id`) the
/// schema is refused as too deep.
const MAX_LOOKUPS: usize = 1 << 20;

impl<'a> Names<'a> {
    /// Every place `reference` can name, from an object inside `resource` (the nearest object
    /// with an `$id` around it, or the root).
    fn targets(&self, root: &'a Value, resource: &'a Value, reference: &str) -> Vec<&'a Value> {
        let (uri, fragment) = reference.split_once('#').unwrap_or((reference, ""));
        let bases: Vec<&'a Value> = if uri.is_empty() {
            vec![root, resource]
        } else {
            // An absolute or a relative URI: every `$id` whose last segment is its last.
            self.ids.get(last_segment(uri)).cloned().unwrap_or_default()
        };
        if fragment.is_empty() {
            return bases;
        }
        if fragment.starts_with('/') {
            let pointer = percent_decode(fragment);
            return bases.iter().filter_map(|b| b.pointer(&pointer)).collect();
        }
        let out: Vec<&'a Value> = self.anchors.get(fragment).cloned().unwrap_or_default();
        out
    }
}

/// What follows a URI's last `/` or `:`.
fn last_segment(uri: &str) -> &str {
    uri.rsplit(['/', ':']).next().unwrap_or(uri)
}

/// `%XX` escapes of a URI fragment decoded (JSON pointers in `$ref`s are written as URI
/// fragments); a malformed escape is kept as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = s.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The keywords whose string value names another schema.
const REFERENCES: [&str; 3] = ["$ref", "$dynamicRef", "$recursiveRef"];

/// The measure of a JSON schema: its containers and the edges of its references.
fn json_schema_depth(schema: &Value) -> usize {
    let mut graph = Graph::default();
    let mut names = Names::default();
    let mut nodes: HashMap<*const Value, usize> = HashMap::new();
    // Every container gets a node, with edges to the containers inside it; each object is kept
    // with the resource around it.
    let mut objects: Vec<(&Value, &Value)> = Vec::new();
    let mut walk: Vec<(&Value, Option<usize>, &Value)> = vec![(schema, None, schema)];
    while let Some((v, parent, resource)) = walk.pop() {
        let node = match v {
            Value::Object(_) | Value::Array(_) => graph.node(1),
            _ => continue,
        };
        nodes.insert(v as *const Value, node);
        if let Some(p) = parent {
            graph.edge(p, node);
        }
        match v {
            Value::Object(map) => {
                let mut resource = resource;
                if let Some(Value::String(id)) = map.get("$id") {
                    let (uri, anchor) = id.split_once('#').unwrap_or((id, ""));
                    if !uri.is_empty() {
                        names.ids.entry(last_segment(uri)).or_default().push(v);
                        resource = v;
                    }
                    if !anchor.is_empty() {
                        names.anchors.entry(anchor).or_default().push(v);
                    }
                }
                for key in ["$anchor", "$dynamicAnchor"] {
                    if let Some(Value::String(a)) = map.get(key) {
                        names.anchors.entry(a.as_str()).or_default().push(v);
                    }
                }
                objects.push((v, resource));
                walk.extend(map.values().map(|c| (c, Some(node), resource)));
            }
            Value::Array(items) => walk.extend(items.iter().map(|c| (c, Some(node), resource))),
            _ => {}
        }
    }
    // A reference adds an edge from its object to every place it can name.
    let mut lookups = 0usize;
    for (v, resource) in objects {
        let Value::Object(map) = v else { continue };
        for key in REFERENCES {
            let Some(Value::String(reference)) = map.get(key) else { continue };
            let from = nodes[&(v as *const Value)];
            let targets = names.targets(schema, resource, reference);
            lookups = lookups.saturating_add(targets.len().max(1));
            if lookups > MAX_LOOKUPS {
                return usize::MAX;
            }
            for target in targets {
                // A reference to a plain value (a string, a number) recurses no further.
                if let Some(&to) = nodes.get(&(target as *const Value)) {
                    graph.edge(from, to);
                }
            }
        }
    }
    graph.heaviest_path().max(1)
}

/// The deepest nesting of groups in a regular expression: `(` outside character classes, and
/// the classes themselves (`[[a]&&[b]]` nests).
fn regex_depth(rx: &str) -> usize {
    let (mut depth, mut deepest, mut class) = (0usize, 0usize, 0usize);
    let mut chars = rx.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '[' => {
                class += 1;
                deepest = deepest.max(depth + class);
            }
            ']' if class > 0 => class -= 1,
            '(' if class == 0 => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            ')' if class == 0 => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest.max(1)
}

/// One piece of Lark text, as llguidance's lexer reads it (only what the measure needs).
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    /// A rule's or a token's name.
    Name(&'a str),
    Colon,
    Newline,
    Open,
    Close,
    /// A regular expression (`/.../`): its nesting.
    Regex(usize),
    /// A `%json`, `%regex` or `%llguidance` value: a schema's measure (or 1).
    Embedded(usize),
    Other,
}

/// The pieces of Lark text. Strings and comments are skipped as the grammar's lexer skips them,
/// so that their words are not taken for names.
fn lark_pieces(text: &str) -> Vec<Piece<'_>> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\n' | b'\r' => {
                out.push(Piece::Newline);
                i += 1;
            }
            b' ' | b'\t' => i += 1,
            b'#' => i = line_end(bytes, i),
            b'/' if bytes.get(i + 1) == Some(&b'/') => i = line_end(bytes, i),
            b'/' => {
                // A regular expression, to its unescaped closing slash.
                let start = i + 1;
                let mut j = start;
                while j < bytes.len() && bytes[j] != b'/' && bytes[j] != b'\n' {
                    j += if bytes[j] == b'\\' { 2 } else { 1 };
                }
                let end = j.min(bytes.len());
                out.push(Piece::Regex(regex_depth(text.get(start..end).unwrap_or_default())));
                i = end + 1;
            }
            b'"' => {
                let mut j = i + 1;
                while j < bytes.len() && bytes[j] != b'"' && bytes[j] != b'\n' {
                    j += if bytes[j] == b'\\' { 2 } else { 1 };
                }
                out.push(Piece::Other);
                i = j + 1;
            }
            b'%' => {
                let j = i + 1 + bytes[i + 1..].iter().take_while(|c| c.is_ascii_alphanumeric() || **c == b'_').count();
                let keyword = &text[i + 1..j];
                i = j;
                if matches!(keyword, "json" | "regex" | "llguidance") {
                    // A JSON value follows; its length is what the JSON parser reads of it.
                    let rest = &text[i..];
                    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                    match values.next() {
                        Some(Ok(v)) => {
                            out.push(Piece::Embedded(if keyword == "json" { json_schema_depth(&v) } else { 1 }));
                            i += values.byte_offset();
                        }
                        _ => out.push(Piece::Other),
                    }
                } else {
                    out.push(Piece::Other);
                }
            }
            b'(' | b'[' => {
                out.push(Piece::Open);
                i += 1;
            }
            b')' | b']' => {
                out.push(Piece::Close);
                i += 1;
            }
            b':' => {
                out.push(if bytes.get(i + 1) == Some(&b':') { Piece::Other } else { Piece::Colon });
                i += if bytes.get(i + 1) == Some(&b':') { 2 } else { 1 };
            }
            _ if b.is_ascii_alphabetic() || b == b'_' || b == b'!' || b == b'?' => {
                let start = i + bytes[i..].iter().take_while(|c| **c == b'!' || **c == b'?').count();
                let j = start + bytes[start..].iter().take_while(|c| c.is_ascii_alphanumeric() || **c == b'_' || **c == b'-').count();
                out.push(if j > start { Piece::Name(&text[start..j]) } else { Piece::Other });
                i = j.max(i + 1);
            }
            _ => {
                // Any other character (a multi-byte one whole).
                out.push(Piece::Other);
                i += text[i..].chars().next().map_or(1, char::len_utf8);
            }
        }
    }
    out
}

fn line_end(bytes: &[u8], from: usize) -> usize {
    from + bytes[from..].iter().take_while(|&&c| c != b'\n').count()
}

/// The measure of a Lark grammar: a node per rule or token, weighing one more than the
/// deepest nesting inside its definition (groups, regular expressions, embedded schemas), with
/// an edge to every name its definition uses.
fn lark_depth(text: &str) -> usize {
    let pieces = lark_pieces(text);
    // A definition starts a line: a name, perhaps a priority or parameters, then a colon.
    let mut starts: Vec<(usize, &str)> = Vec::new();
    let mut at_line_start = true;
    for (i, p) in pieces.iter().enumerate() {
        match p {
            Piece::Newline => at_line_start = true,
            Piece::Name(name) if at_line_start => {
                let rest = &pieces[i + 1..];
                let colon = rest.iter().take_while(|q| !matches!(q, Piece::Newline)).position(|q| *q == Piece::Colon);
                // Between the name and the colon only a priority or parameters (no other name
                // then the colon of a rule's own body).
                if colon.is_some_and(|c| rest[..c].iter().all(|q| matches!(q, Piece::Other | Piece::Name(_) | Piece::Open | Piece::Close)) && c <= 8) {
                    starts.push((i, name));
                }
                at_line_start = false;
            }
            _ => at_line_start = false,
        }
    }
    let mut graph = Graph::default();
    let mut ids: HashMap<&str, usize> = HashMap::new();
    for &(_, name) in &starts {
        let id = *ids.entry(name).or_insert_with(|| graph.node(1));
        let _ = id;
    }
    for (k, &(at, name)) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(pieces.len(), |&(next, _)| next);
        let from = ids[name];
        let (mut nest, mut deepest) = (0usize, 0usize);
        for p in &pieces[at + 1..end] {
            match p {
                Piece::Open => {
                    nest += 1;
                    deepest = deepest.max(nest);
                }
                Piece::Close => nest = nest.saturating_sub(1),
                Piece::Regex(d) | Piece::Embedded(d) => deepest = deepest.max(nest + d),
                Piece::Name(used) => {
                    if let Some(&to) = ids.get(used) {
                        graph.edge(from, to);
                    }
                }
                _ => {}
            }
        }
        graph.weight[from] = graph.weight[from].max(1 + deepest);
    }
    // Text outside every definition (an embedded value alone) still counts.
    let loose = pieces.iter().map(|p| if let Piece::Regex(d) | Piece::Embedded(d) = p { *d } else { 0 }).max().unwrap_or(0);
    graph.heaviest_path().max(loose).max(1)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chain_schema(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(format!("A{i}"), json!({"$ref": format!("#/$defs/A{}", i + 1)}));
        }
        defs.insert(format!("A{n}"), json!({"type": "integer"}));
        json!({"$ref": "#/$defs/A0", "$defs": defs})
    }

    #[test]
    fn a_chain_of_references_is_as_deep_as_it_is_long() {
        let d = |n| json_schema_depth(&chain_schema(n));
        assert!(d(700) >= 700, "{}", d(700));
        assert!(d(700) <= 710, "{}", d(700));
        assert!(d(10) < 20);
    }

    #[test]
    fn nesting_without_references_counts_its_containers() {
        let mut v = json!({"type": "string"});
        for _ in 0..50 {
            v = json!({"type": "object", "properties": {"a": v}});
        }
        let d = json_schema_depth(&v);
        assert!((100..=102).contains(&d), "{d}");
    }

    #[test]
    fn a_recursive_schema_weighs_its_cycle_not_its_instances() {
        let tree = json!({
            "$ref": "#/$defs/node",
            "$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}
        });
        let d = json_schema_depth(&tree);
        assert!(d < 12, "{d}");
    }

    #[test]
    fn references_by_anchor_by_id_and_escaped_pointers_are_followed() {
        let mut defs = serde_json::Map::new();
        for i in 0..300 {
            // Alternating spellings: an anchor, an id, a percent-escaped pointer.
            let next = match i % 3 {
                0 => format!("#a{}", i + 1),
                1 => format!("urn:x:b{}", i + 1),
                _ => format!("#/$defs/c%20{}", i + 1),
            };
            defs.insert(format!("c {i}"), json!({"$ref": next, "$anchor": format!("a{i}"), "$id": format!("urn:x:b{i}")}));
        }
        let d = json_schema_depth(&json!({"$ref": "#/$defs/c 0", "$defs": defs}));
        assert!(d >= 300, "{d}");
    }

    #[test]
    fn a_rule_chain_is_as_deep_as_it_is_long_and_strings_and_comments_are_not_names() {
        let mut g = String::from("start: r0\n");
        for i in 0..1000 {
            g.push_str(&format!("r{i}: \"r{}: x\" r{} // r0 r1\n", i + 1, i + 1));
        }
        g.push_str("r1000: \"end\"\n");
        let d = lark_depth(&g);
        assert!((1000..=1010).contains(&d), "{d}");
        let tokens: String = (0..500).map(|i| format!("T{i}: T{}\n", i + 1)).collect::<String>() + "T500: /a/\nstart: T0\n";
        assert!(lark_depth(&tokens) >= 500);
    }

    #[test]
    fn lark_counts_groups_regexes_and_embedded_schemas() {
        let groups = format!("start: {}\"a\"{}\n", "(".repeat(40), ")".repeat(40));
        assert!(lark_depth(&groups) >= 40);
        let rx = format!("start: /{}a{}/\n", "(".repeat(60), ")".repeat(60));
        assert!(lark_depth(&rx) >= 60);
        let schema = serde_json::to_string(&chain_schema(400)).unwrap();
        let g = format!("start: \"x\" j\nj: %json {schema}\n");
        assert!(lark_depth(&g) >= 400, "{}", lark_depth(&g));
        // A multi-line rule with alternatives is one definition.
        let alts = "start: a\n    | b\na: \"x\"\nb: \"y\"\n";
        assert_eq!(lark_depth(alts), 2);
    }

    #[test]
    fn regexes_count_groups_but_not_escaped_or_classed_parentheses() {
        assert_eq!(regex_depth("((a)(b))"), 2);
        assert_eq!(regex_depth(r"\(\(\(a"), 1);
        assert_eq!(regex_depth("[(((]a"), 1);
        assert_eq!(regex_depth(&"(".repeat(500)), 500);
    }
}
