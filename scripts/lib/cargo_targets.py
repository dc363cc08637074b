"""What test.sh needs to know of cargo's targets, from cargo's own JSON.

  python3 scripts/lib/cargo_targets.py executables FILE
      each test or benchmark executable a `cargo ... --message-format=json` build wrote
      (FILE holds its output): "NAME PATH" per line
  cargo metadata --no-deps --format-version 1 | python3 scripts/lib/cargo_targets.py tests-except NAME...
      each integration test target of the workspace but the ones named, one per line
"""
import json
import sys


def executables(path):
    for line in open(path):
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and \
                set(m["target"]["kind"]) & {"test", "bench"}:
            print(m["target"]["name"], m["executable"])


def tests_except(names):
    for package in json.load(sys.stdin)["packages"]:
        for target in package["targets"]:
            if "test" in target["kind"] and target["name"] not in names:
                print(target["name"])


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "executables":
        executables(args[0])
    elif command == "tests-except":
        tests_except(set(args))
    else:
        sys.exit(f"unknown command {command!r}: executables FILE, tests-except NAME...")
