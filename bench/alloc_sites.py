"""Allocation call sites per request, from `perf script` of uprobes on mimalloc (bench/allocs.sh).

Reads perf script's output (one block per allocation, innermost frame first) on stdin and the
exact allocations per request (from the counting run) as its argument; prints the most frequent
call sites, each as its first frames outside the allocator, std, core and alloc, with its share
of that count. perf drops samples when call graphs come faster than it writes them, so the
recording gives each site's share, and the counting run the total.
"""

import collections
import re
import sys

# Frames that say how, not where: the allocator, and std/core/alloc plumbing around it.
PLUMBING = re.compile(
    r"^(mi_|_mi_|__rust|__rdl|alloc$|alloc_impl|allocate|box_new|exchange_malloc|new$|new<|from<"
    r"|clone|to_vec|to_owned|into|with_capacity|reserve|grow|finish_grow|do_reserve|try_reserve"
    r"|RawVec|alloc::|core::|std::|<alloc|<core|<std|spec_|from_iter|collect|extend|push"
    r"|try_allocate_in|allocate_in|copy_from_slice|to_string|default)"
)


def frames(block):
    for line in block.splitlines()[1:]:
        parts = line.strip().split(" ", 1)
        if len(parts) < 2:
            continue
        name = re.sub(r" \((inlined|/.*|\[.*\])\)$", "", parts[1])
        name = re.sub(r"\+0x[0-9a-f]+$", "", name)
        # Generic arguments make one site many; keep the path.
        if not name.startswith("<"):
            name = name.split("<")[0]
        yield name[:100]


def main():
    per_request = float(sys.argv[1])
    sites = collections.Counter()
    total = 0
    for block in sys.stdin.read().split("\n\n"):
        if not block.strip():
            continue
        total += 1
        where = [f for f in frames(block) if not PLUMBING.search(f)][:3]
        sites[" <- ".join(where) or "(allocator only)"] += 1
    if not total:
        print("  no allocation sampled")
        return
    print(f"  allocation sites ({total} sampled), per request:")
    for site, n in sites.most_common(25):
        share = n * per_request / total
        if share >= 0.05:
            print(f"  {share:6.2f}  {site}")


if __name__ == "__main__":
    main()
