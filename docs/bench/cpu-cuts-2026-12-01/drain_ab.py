"""Ad hoc (2026-12-01, session 27), kept as it ran: one worker drains N fresh movements on the local services
(`make services`), timed from spawn; prints the rate from spawn, the first commit, the steady rate and the worker's
CPU per 100k, then its log's start-up events (with STOCK_LEDGER_LOG_LEVEL=debug also each commit and, with the
txn-split patch of txn-split.txt applied, the transaction's steps). Each repetition: a new topic, the ledger
tables truncated, a CHECKPOINT. Arguments: N, repetitions, then VAR=VALUE for the worker (PYTHONPATH=<tree>/src
runs another commit's worker). SPY=1 in the environment records the worker with py-spy into /tmp/s27/spy.txt.
Paths (/work/main, /tmp/s27, /tmp/spy) are this session's.
"""
import asyncio, os, subprocess, sys, time, json, random
import asyncpg
os.chdir('/work/main')
OWNER=subprocess.check_output(['scripts/postgres.sh','url'],text=True).strip()
WORKER=subprocess.check_output(['scripts/postgres.sh','worker-url'],text=True).strip()
N=int(sys.argv[1]) if len(sys.argv)>1 else 200000
reps=int(sys.argv[2]) if len(sys.argv)>2 else 3
extra=dict(a.split('=',1) for a in sys.argv[3:])
async def main():
    res=[]
    for r in range(reps):
        topic=f"st.startup.{random.randrange(10**9)}"
        env=dict(os.environ, KAFKA_BOOTSTRAP_SERVERS='127.0.0.1:9092', STOCK_LEDGER_TOPIC=topic, STOCK_LEDGER_GROUP_ID='st-startup', STOCK_LEDGER_LOG_LEVEL='info', STOCK_LEDGER_METRICS_PORT='9555', DATABASE_URL=OWNER)
        subprocess.run(['.venv/bin/stock-ledger','create-topic'],env=env,check=True,capture_output=True)
        subprocess.run(['.venv/bin/stock-ledger','produce','--count',str(N)],env=env,check=True,capture_output=True)
        c=await asyncpg.connect(OWNER)
        await c.execute("truncate stock_movements, rejected_movements, consumer_offsets, stock_levels, ledger_gaps")
        subprocess.run(["runuser","-u","postgres","--","psql","-X","-q","-p","5432","-d","postgres","-c","checkpoint"],check=True)
        env['DATABASE_URL']=WORKER; env.update(extra)
        log=open(f'/tmp/s27/startup-{r}.log','w')
        t0=time.time()
        p=subprocess.Popen(['.venv/bin/stock-ledger','run'],env=env,stdout=log,stderr=subprocess.STDOUT)
        first=None
        spy=None
        if os.environ.get('SPY'):
            await asyncio.sleep(2)
            spy=subprocess.Popen(['/tmp/spy/bin/py-spy','record','--rate','200','--duration','12','--format','raw','-o','/tmp/s27/spy.txt','--pid',str(p.pid)],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
        while True:
            n=await c.fetchval("select coalesce(sum(next_offset),0) from consumer_offsets")
            now=time.time()
            if n>0 and first is None: first=now
            if n>=N: break
            await asyncio.sleep(0.02)
        import psutil
        ct=psutil.Process(p.pid).cpu_times(); cpu=ct.user+ct.system
        p.terminate(); p.wait()
        if spy: spy.wait()
        await c.close()
        total=now-t0
        res.append((total, first-t0, N/total))
        print(f"rep {r}: {N/total:,.0f}/s from start, first commit at {first-t0:.2f}s, steady {N/(now-first):,.0f}/s, CPU {cpu/N*1e5:.2f} s/100k", flush=True)
        # timeline
        for line in open(f'/tmp/s27/startup-{r}.log'):
            try: j=json.loads(line)
            except Exception: continue
            ev=j.get('event')
            if True:
                import datetime
                ts=datetime.datetime.fromisoformat(j['timestamp'].replace('Z','+00:00')).timestamp()
                if ev!='claim.reset_policy' and ts-t0<1.3: print('   %+.3f'%(ts-t0), ev, {k:(round(v-t0,3) if k in ('fetched','began') else v) for k,v in j.items() if k in ('applied','seconds','fetched','began','ms','n')})
    print(sorted(res))
asyncio.run(main())
