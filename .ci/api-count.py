#!/usr/bin/env python3
"""Count the crate's public named items from rustdoc's JSON output.

Usage: cargo +nightly rustdoc --all-features --lib -- -Z unstable-options --output-format json
       python3 .ci/api-count.py target/doc/tower_redis_lock.json [--list]

Counts every item of this crate that has a public path (structs, enums,
traits, constants, type aliases, free functions, macros, statics, unions);
modules and re-exports are listed apart and not counted.
"""
import json, sys, collections

doc = json.load(open(sys.argv[1]))
kinds = collections.Counter()
names = []
for id_, p in doc["paths"].items():
    if p["crate_id"] != 0:
        continue
    k = p["kind"]
    if k in ("module",):
        continue
    if k in ("struct", "enum", "trait", "constant", "type_alias", "function", "macro", "static", "union", "trait_alias"):
        kinds[k] += 1
        names.append((k, "::".join(p["path"])))
total = sum(kinds.values())
print(f"public named items: {total}  " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())))
if "--list" in sys.argv:
    for k, n in sorted(names, key=lambda x: x[1]):
        print(f"  {k:10} {n}")
