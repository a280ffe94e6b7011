"""Converts a table printed by the bench tool (columns: case system metric value[unit] [p50 p99] n [vs fido])
into JSON lines of DESIGN §8's shape: suite, case, system, metric, value, unit, p50, p99, n."""
import re, json, sys
SCALE = {'ns': 1e-9, 'µs': 1e-6, 'ms': 1e-3, 's': 1.0}
BYTES = {'B/s': 1, 'kB/s': 1e3, 'KB/s': 1e3, 'MB/s': 1e6, 'GB/s': 1e9}
def canon(metric):
    if metric.endswith('_ns'): return 'ns'
    if metric.endswith('bytes_per_s'): return 'B/s'
    return None
def to(v, u, target):
    if target == 'ns' and u in SCALE: return v * SCALE[u] / 1e-9
    if target == 'B/s' and u in BYTES: return v * BYTES[u]
    return v
def main(path, suite, source):
    for l in open(path, encoding='utf-8'):
        l = l.rstrip('\n')
        if not l.strip() or l.startswith(('#', 'case', '---')): continue
        t = l.split()
        case, system, metric, rest = t[0], t[1], t[2], t[3:]
        if metric == 'did_not_finish':
            rec = dict(suite=suite, case=case, system=system, metric=metric, value=float(rest[0]), unit='s',
                       p50=None, p99=None, n=0, note=' '.join(rest[2:-1]) or 'budget')
        else:
            pairs = []; i = 0
            while i < len(rest):
                if i + 1 < len(rest) and not re.match(r'^[\d.eE+-]+x?$', rest[i + 1]):
                    pairs.append((float(rest[i]), rest[i + 1])); i += 2
                else:
                    pairs.append((rest[i], None)); i += 1
            target = canon(metric)
            v, u = pairs[0]
            unit = target or u
            with_unit = [p for p in pairs[1:] if p[1] is not None]
            bare = [p[0] for p in pairs[1:] if p[1] is None and not str(p[0]).endswith('x')]
            rec = dict(suite=suite, case=case, system=system, metric=metric, value=to(v, u, target), unit=unit,
                       p50=to(*with_unit[0], target) if len(with_unit) > 0 else None,
                       p99=to(*with_unit[1], target) if len(with_unit) > 1 else None,
                       n=int(bare[0]) if bare else None)
        for k in ("value","p50","p99"):
            if isinstance(rec.get(k), float): rec[k] = float(f"{rec[k]:.6g}")
        rec["source"] = source
        print(json.dumps(rec, ensure_ascii=False))
main(sys.argv[1], sys.argv[2], sys.argv[3])
