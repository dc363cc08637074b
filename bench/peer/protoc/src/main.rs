//! `protox-protoc`: the subset of `protoc` that prost-build 0.11 runs, done by protox (a
//! pure-Rust protobuf compiler), so that building the fan-out benchmark's peer needs no
//! system protobuf compiler and no system copy of the well-known types (protox carries
//! `google/protobuf/*.proto`).
//!
//! `protox-protoc [-I DIR]... -o OUT [--include_imports] [--include_source_info] FILE...`
//!
//! Why not protox's own command: it compiles every input into one pool and resolves a
//! relative name against every package in that pool, where protoc resolves a file's names
//! against the packages of that file and its direct imports only. Envoy's protos rely on
//! protoc's rule (`config.core.v3.X` inside `envoy.extensions.filters...` would otherwise
//! resolve into the unrelated `envoy.extensions.config`), so here each input is compiled
//! with a pool of its own (the file and what it imports) and the results are merged by file
//! name. The merge keeps protoc's order: a file always comes after the files it imports.
//! (Isolation is per input: an input's imports share its pool, which Envoy's protos never
//! trip on; a clash there fails loudly, never silently. Custom options on descriptors are
//! not kept in the merged set; prost-build's generated code does not read them.)

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;

use prost::Message;

struct Args {
    includes: Vec<PathBuf>,
    output: PathBuf,
    include_imports: bool,
    include_source_info: bool,
    files: Vec<PathBuf>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    // protox always allows proto3 `optional`: protoc's flag for it changes nothing here.
    const IGNORED: &[&str] = &["--experimental_allow_proto3_optional"];
    let mut includes = Vec::new();
    let mut output = None;
    let (mut include_imports, mut include_source_info) = (false, false);
    let mut files = Vec::new();
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| args.next().ok_or(format!("{flag} needs a value"));
        match arg.as_str() {
            "-I" | "--proto_path" => includes.push(PathBuf::from(value(&arg)?)),
            "-o" | "--descriptor_set_out" => output = Some(PathBuf::from(value(&arg)?)),
            "--include_imports" => include_imports = true,
            "--include_source_info" => include_source_info = true,
            _ if IGNORED.contains(&arg.as_str()) => {}
            _ if arg.starts_with("-I") => includes.push(PathBuf::from(&arg[2..])),
            _ if arg.starts_with("--proto_path=") => {
                includes.push(PathBuf::from(&arg["--proto_path=".len()..]))
            }
            _ if arg.starts_with("-o") => output = Some(PathBuf::from(&arg[2..])),
            _ if arg.starts_with("--descriptor_set_out=") => {
                output = Some(PathBuf::from(&arg["--descriptor_set_out=".len()..]))
            }
            _ if arg.starts_with('-') => return Err(format!("unsupported option {arg}")),
            _ => files.push(PathBuf::from(arg)),
        }
    }
    if includes.is_empty() {
        includes.push(PathBuf::from("."));
    }
    let output = output.ok_or("-o OUT is required")?;
    if files.is_empty() {
        return Err("no input files".into());
    }
    Ok(Args {
        includes,
        output,
        include_imports,
        include_source_info,
        files,
    })
}

fn compile(args: &Args) -> Result<prost_types::FileDescriptorSet, String> {
    let mut merged = prost_types::FileDescriptorSet::default();
    let mut seen = HashSet::new();
    for file in &args.files {
        let mut compiler = protox::Compiler::new(&args.includes).map_err(|e| format!("{e:?}"))?;
        compiler
            .include_imports(args.include_imports)
            .include_source_info(args.include_source_info)
            .open_file(file)
            .map_err(|e| format!("{}: {e:?}", file.display()))?;
        for descriptor in compiler.file_descriptor_set().file {
            if seen.insert(descriptor.name().to_owned()) {
                merged.file.push(descriptor);
            }
        }
    }
    Ok(merged)
}

fn main() -> ExitCode {
    let args: Result<Vec<String>, _> = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("an argument that is not UTF-8: {a:?}"))
        })
        .collect();
    let result = args
        .and_then(|a| parse_args(a.into_iter()))
        .and_then(|args| {
            let set = compile(&args)?;
            std::fs::write(&args.output, set.encode_to_vec())
                .map_err(|e| format!("{}: {e}", args.output.display()))
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("protox-protoc: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three files where a relative name means what protoc says only if each file sees the
    /// packages of its own imports: `config.core.v3.Flag` in `envoy.extensions.filters.v3`
    /// is `envoy.config.core.v3.Flag`, because no import defines `envoy.extensions.config`.
    #[test]
    fn names_resolve_against_each_file_s_own_imports_as_protoc_does() {
        let dir = std::env::temp_dir().join(format!("protox-protoc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        write(
            "unrelated.proto",
            "syntax = \"proto3\"; package envoy.extensions.config.v3; message Other {}",
        );
        write(
            "flag.proto",
            "syntax = \"proto3\"; package envoy.config.core.v3; message Flag {}",
        );
        write(
            "filter.proto",
            "syntax = \"proto3\"; package envoy.extensions.filters.v3; import \"flag.proto\";\n\
             message Filter { config.core.v3.Flag enabled = 1; }",
        );
        let args = |files: &[&str]| Args {
            includes: vec![dir.clone()],
            output: dir.join("out.pb"),
            include_imports: true,
            include_source_info: false,
            files: files.iter().map(|f| dir.join(f)).collect(),
        };

        let set = compile(&args(&["unrelated.proto", "filter.proto"])).unwrap();
        let names: Vec<&str> = set.file.iter().map(|f| f.name()).collect();
        assert_eq!(names, ["unrelated.proto", "flag.proto", "filter.proto"]);
        let filter = set
            .file
            .iter()
            .find(|f| f.name() == "filter.proto")
            .unwrap();
        assert_eq!(
            filter.message_type[0].field[0].type_name(),
            ".envoy.config.core.v3.Flag"
        );

        // The reason for this command: protox's own, with one pool for all inputs, refuses it.
        let mut one_pool = protox::Compiler::new([&dir]).unwrap();
        let refused = one_pool
            .open_files([dir.join("unrelated.proto"), dir.join("filter.proto")])
            .expect_err("one pool for both files resolves into envoy.extensions.config");
        assert!(refused.to_string().contains("resolves to"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn arguments_as_prost_build_gives_them() {
        let args = parse_args(
            [
                "--include_imports",
                "--include_source_info",
                "-o",
                "/tmp/set.pb",
                "-I",
                "a",
                "-Ib",
                "x.proto",
            ]
            .map(String::from)
            .into_iter(),
        )
        .unwrap();
        assert_eq!(args.includes, [PathBuf::from("a"), PathBuf::from("b")]);
        assert_eq!(args.output, PathBuf::from("/tmp/set.pb"));
        assert!(args.include_imports && args.include_source_info);
        assert_eq!(args.files, [PathBuf::from("x.proto")]);
        assert!(parse_args(["--cpp_out=x", "a.proto"].map(String::from).into_iter()).is_err());
        let ignored = ["--experimental_allow_proto3_optional", "-o", "o", "a.proto"];
        assert!(parse_args(ignored.map(String::from).into_iter()).is_ok());
        assert!(parse_args(["a.proto"].map(String::from).into_iter()).is_err());
    }
}
