"""20 cold reads (the bench's asks, seed 39) on a ledger the reads bench already loaded."""
import asyncio, contextlib, json, random, statistics, sys
import asyncpg
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from scripts.benchmarks import reads as R
DB = sys.argv[1]
class B:
    @contextlib.asynccontextmanager
    async def owner(self):
        c = await asyncpg.connect(f"postgresql://stock_ledger:stock_ledger@127.0.0.1:5432/{DB}")
        try:
            yield c
        finally:
            await c.close()
async def main():
    b = B(); rng = random.Random(39)
    async with b.owner() as c:
        placed = [r[0] for r in await c.fetch("SELECT positioned_at FROM ledger_closings ORDER BY 1")]
    first, last = placed[0], placed[-1]
    asks = [(f"WH-{rng.randrange(20):03d}", first + (last - first) * rng.random(), f"SKU-{rng.randrange(5000):06d}") for _ in range(20)]
    out = []
    for n, (w, at, sku) in enumerate(asks):
        st = []
        ws, lv = await R._cold_read(b, (w, at, None), statements=st)
        ss, one = await R._cold_read(b, (w, at, sku))
        print(f"read {n+1}: {w} {at.isoformat()} warehouse {ws:.3f}s sku {ss:.3f}s ({len(lv)} skus)", flush=True)
        out.append({"warehouse": w, "at": at.isoformat(), "sku": sku, "warehouse_seconds": ws, "sku_seconds": ss, "statements": st})
    for k in ("warehouse_seconds", "sku_seconds"):
        v = sorted(x[k] for x in out)
        print(k, "median", round(statistics.median(v), 3), "p95", round(v[int(0.95 * (len(v) - 1) + 0.5)], 3), "max", round(v[-1], 3))
    json.dump(out, open(sys.argv[2], "w"), indent=1, default=str)
asyncio.run(main())
