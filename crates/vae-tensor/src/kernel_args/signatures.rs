//! The argument structs against the kernels' own declarations: `kernels-cu/*.cu` read, its
//! function-like macros expanded (the kernels written once over a storage type are declared
//! inside them), and every `extern "C" __global__` signature compared with the struct that
//! launches it, parameter by parameter. Also the by-value structs of [`crate::abi`] against the
//! C structs they mirror. Needs no GPU and no compiled kernels.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use super::{Declared, Elem, Instance, Param, declared};
use crate::DType;
use crate::abi::{Box8, ConvGeom};
use crate::cuda::kernels::ALL;

/// A kernel's parameters as declared: `(C type, name)`, the type with single spaces and `*`
/// against it (`const unsigned short*`).
type Params = Vec<(String, String)>;

fn kernels_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../kernels-cu")
}

/// `source` with continued lines joined and comments removed (string literals kept), as the C
/// preprocessor's first phases leave it.
fn strip(source: &str) -> String {
    let joined = source.replace("\\\r\n", " ").replace("\\\n", " ");
    let (mut out, mut chars) = (String::new(), joined.chars().peekable());
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('/', Some('/')) => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
            }
            ('/', Some('*')) => {
                chars.next();
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
                out.push(' ');
            }
            ('"', _) => {
                out.push(c);
                for c in chars.by_ref() {
                    out.push(c);
                    if c == '"' {
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The text up to the parenthesis that closes the one `text` starts after, and the rest after it.
fn balanced(text: &str) -> Option<(&str, &str)> {
    let mut depth = 1;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// `text` split at its commas outside parentheses, each part trimmed.
fn split_top(text: &str) -> Vec<String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(text[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(text[start..].trim().to_string());
    parts
}

/// A function-like macro: its parameters and body.
struct Macro {
    params: Vec<String>,
    body: String,
}

impl Macro {
    /// The body with `args` for the parameters, then `##` pasted.
    fn expand(&self, args: &[String]) -> String {
        let mut out = String::new();
        let mut rest = self.body.as_str();
        while let Some(start) = rest.find(|c: char| is_ident(c)) {
            out.push_str(&rest[..start]);
            let end = rest[start..].find(|c: char| !is_ident(c)).map_or(rest.len(), |e| start + e);
            let word = &rest[start..end];
            match self.params.iter().position(|p| p == word) {
                Some(k) => out.push_str(&args[k]),
                None => out.push_str(word),
            }
            rest = &rest[end..];
        }
        out.push_str(rest);
        let pieces: Vec<&str> = out.split("##").collect();
        let last = pieces.len() - 1;
        let trimmed = pieces.iter().enumerate().map(|(i, p)| match (i == 0, i == last) {
            (true, true) => *p,
            (true, false) => p.trim_end(),
            (false, true) => p.trim_start(),
            (false, false) => p.trim(),
        });
        trimmed.collect()
    }
}

/// The program text of one `.cu` file (its own directives dropped) with its own function-like
/// macros expanded.
fn expanded(source: &str) -> String {
    let mut macros = HashMap::new();
    let mut code = String::new();
    for line in strip(source).lines() {
        let line = line.trim();
        if let Some(define) = line.strip_prefix("#define") {
            let define = define.trim_start();
            let name_end = define.find(|c: char| !is_ident(c)).unwrap_or(define.len());
            if let Some(after) = define[name_end..].strip_prefix('(')
                && let Some((params, body)) = balanced(after)
            {
                let params = split_top(params).into_iter().filter(|p| !p.is_empty()).collect();
                macros.insert(define[..name_end].to_string(), Macro { params, body: body.trim().to_string() });
            }
        } else if !line.starts_with('#') {
            code.push_str(line);
            code.push('\n');
        }
    }
    // Invocations, outermost first; an expansion is scanned again (for nested ones).
    for _ in 0..1000 {
        let found = macros.iter().find_map(|(name, m)| {
            let mut from = 0;
            while let Some(at) = code[from..].find(name.as_str()).map(|a| from + a) {
                from = at + name.len();
                let before = code[..at].chars().next_back();
                let after = code[from..].trim_start();
                if before.is_some_and(is_ident) || code[from..].starts_with(is_ident) || !after.starts_with('(') {
                    continue;
                }
                let (args, rest) = balanced(&after[1..])?;
                let end = code.len() - rest.len();
                return Some((at, end, m.expand(&split_top(args))));
            }
            None
        });
        match found {
            Some((start, end, text)) => code.replace_range(start..end, &text),
            None => return code,
        }
    }
    panic!("macro expansion does not end");
}

/// Every `extern "C" __global__ void` entry point declared in `code`, by name.
fn entry_points(code: &str) -> BTreeMap<String, Params> {
    let mut found = BTreeMap::new();
    let mut rest = code;
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + "extern \"C\"".len()..];
        let Some(after) = rest.trim_start().strip_prefix("__global__") else { continue };
        let Some(mut after) = after.trim_start().strip_prefix("void") else { continue };
        after = after.trim_start();
        if let Some(bounds) = after.strip_prefix("__launch_bounds__") {
            let (_, past) = balanced(&bounds.trim_start()[1..]).expect("balanced launch bounds");
            after = past.trim_start();
        }
        let name_end = after.find(|c: char| !is_ident(c)).expect("a kernel name");
        let (name, after) = (&after[..name_end], after[name_end..].trim_start());
        let (params, _) = balanced(after.strip_prefix('(').expect("a parameter list")).expect("balanced parameters");
        let params = split_top(params)
            .into_iter()
            .map(|p| {
                let name_at = p.rfind(|c: char| !is_ident(c)).map_or(0, |i| i + 1);
                let ty = p[..name_at].split_whitespace().collect::<Vec<_>>().join(" ").replace(" *", "*");
                (ty, p[name_at..].to_string())
            })
            .collect();
        found.insert(name.to_string(), params);
    }
    found
}

/// Every entry point of `kernels-cu/*.cu`, by `(module, name)`.
fn declarations() -> HashMap<(String, String), Params> {
    let mut all = HashMap::new();
    for entry in std::fs::read_dir(kernels_dir()).expect("kernels-cu/") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let module = path.file_stem().expect("a file name").to_string_lossy().to_string();
        let source = std::fs::read_to_string(&path).expect("a readable kernel file");
        for (name, params) in entry_points(&expanded(&source)) {
            all.insert((module.clone(), name), params);
        }
    }
    all
}

/// `param`'s C type in `instance`, as [`entry_points`] normalises types.
fn c_type(param: Param, instance: &Instance) -> String {
    let storage = |d: DType| if d == DType::BF16 { "unsigned short" } else { "float" };
    match param {
        Param::Ptr { elem, mutable } => {
            let elem = match elem {
                Elem::Type(name) => match instance.types.iter().find(|(t, _)| *t == name) {
                    Some(&(_, d)) => storage(d).to_string(),
                    None => format!("<{name} not in {:?}>", instance.types),
                },
                Elem::F32 => "float".into(),
                Elem::Bf16 => "unsigned short".into(),
                Elem::F64 => "double".into(),
            };
            format!("{}{elem}*", if mutable { "" } else { "const " })
        }
        Param::U64 => "u64".into(),
        Param::I64 => "i64".into(),
        Param::F32 => "float".into(),
        Param::I32 => "int".into(),
        Param::Struct(name) => name.into(),
    }
}

/// Where the argument structs differ from `decls`, one line each.
fn mismatches(decls: &HashMap<(String, String), Params>) -> Vec<String> {
    let mut wrong = Vec::new();
    for Declared { name, params, instances } in declared() {
        for instance in &instances {
            let (module, kernel) = (instance.kernel.module, instance.kernel.name);
            let Some(theirs) = decls.get(&(module.to_string(), kernel.to_string())) else {
                wrong.push(format!("{name}: no kernel {kernel} in {module}.cu"));
                continue;
            };
            let ours: Params = params
                .iter()
                .map(|&(field, param)| (c_type(param, instance), field.trim_start_matches("r#").to_string()))
                .collect();
            let same = ours.len() == theirs.len()
                && ours.iter().zip(theirs).all(|((t, n), (dt, dn))| t == dt && n.eq_ignore_ascii_case(dn));
            if !same {
                wrong.push(format!(
                    "{name} launching {module}.cu's {kernel}:\n  declared {theirs:?}\n  struct   {ours:?}"
                ));
            }
        }
    }
    wrong
}

#[test]
fn every_argument_struct_matches_its_kernels_declarations() {
    let decls = declarations();
    // The parser sees the kernels written inside macros (f32 and bf16 from one body).
    let add = &decls[&("elementwise".to_string(), "add_bf16".to_string())];
    assert_eq!(add[0], ("const unsigned short*".to_string(), "a".to_string()));
    assert!(decls.contains_key(&("conv".to_string(), "conv3d_tc_tf32_m4_n256".to_string())));
    assert!(decls.contains_key(&("conv_sm90a".to_string(), "conv3d_wgmma_bf16_n192".to_string())));
    let wrong = mismatches(&decls);
    assert!(wrong.is_empty(), "argument structs that differ from kernels-cu/:\n{}", wrong.join("\n"));
}

#[test]
fn a_drifted_declaration_fails_the_comparison() {
    let mut decls = declarations();
    let key = ("norm".to_string(), "group_norm_partials_f32".to_string());
    // Two scalars of one type swapped, then a pointer losing its `const`, then a parameter
    // dropped: each is a difference.
    let original = decls[&key].clone();
    decls.get_mut(&key).expect("declared").swap(2, 3);
    assert_eq!(mismatches(&decls).len(), 1);
    let mut unconst = original.clone();
    unconst[0].0 = "float*".into();
    decls.insert(key.clone(), unconst);
    assert_eq!(mismatches(&decls).len(), 1);
    decls.insert(key.clone(), original[..3].to_vec());
    assert_eq!(mismatches(&decls).len(), 1);
    decls.insert(key, original);
    assert!(mismatches(&decls).is_empty());
}

#[test]
fn every_kernel_the_backend_names_has_a_typed_launcher() {
    let launched: Vec<_> = declared().into_iter().flat_map(|d| d.instances).map(|i| i.kernel).collect();
    for k in ALL {
        assert!(launched.contains(k), "{}.cu's {} has no argument struct", k.module, k.name);
    }
}

/// The fields of `name`'s C definition in `source` with their sizes and alignments in bytes
/// (arrays as their element count times the element's size).
fn c_struct(source: &str, name: &str) -> Vec<(String, usize, usize)> {
    let code = strip(source);
    let start = code.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("no struct {name}"));
    let body = &code[start..];
    let body = &body[body.find('{').expect("a body") + 1..body.find("};").expect("an end")];
    let mut fields = Vec::new();
    for declaration in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let (ty, names) = declaration.split_once(' ').expect("a type and names");
        let size = match ty {
            "u64" | "i64" | "double" => 8,
            "int" | "unsigned" | "float" => 4,
            other => panic!("{name}: a field of type {other}"),
        };
        for field in names.split(',').map(str::trim) {
            match field.split_once('[') {
                Some((f, count)) => {
                    let count: usize = count.trim_end_matches(']').parse().expect("an array length");
                    fields.push((f.to_string(), size * count, size));
                }
                None => fields.push((field.to_string(), size, size)),
            }
        }
    }
    fields
}

/// The field names of a derived `Debug` rendering, in order.
fn debug_fields(debug: &str) -> Vec<String> {
    let inner = &debug[debug.find('{').expect("a struct") + 1..debug.rfind('}').expect("a struct")];
    split_top(inner).iter().map(|f| f.split(':').next().expect("a field").trim().to_string()).collect()
}

/// The size and alignment C gives `fields`.
fn c_layout(fields: &[(String, usize, usize)]) -> (usize, usize) {
    let align = fields.iter().map(|f| f.2).max().unwrap_or(1);
    let end = fields.iter().fold(0usize, |at, (_, size, a)| at.next_multiple_of(*a) + size);
    (end.next_multiple_of(align), align)
}

#[test]
fn the_by_value_structs_match_their_c_definitions() {
    let read = |file: &str| std::fs::read_to_string(kernels_dir().join(file)).expect("a kernel source");
    let cases = [
        (
            c_struct(&read("conv_common.cuh"), "ConvGeom"),
            format!("{:?}", ConvGeom::default()),
            size_of::<ConvGeom>(),
            align_of::<ConvGeom>(),
        ),
        (
            c_struct(&read("layout.cu"), "Box8"),
            format!("{:?}", Box8::new(&[], &[], &[]).expect("an empty box")),
            size_of::<Box8>(),
            align_of::<Box8>(),
        ),
    ];
    for (c, debug, size, align) in cases {
        let names: Vec<&String> = c.iter().map(|f| &f.0).collect();
        let ours = debug_fields(&debug);
        assert_eq!(names, ours.iter().collect::<Vec<_>>(), "fields of {debug}");
        assert_eq!(c_layout(&c), (size, align), "size and alignment of {debug}");
    }
}
