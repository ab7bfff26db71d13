import json,sys
for f in sys.argv[1:]:
    d=json.load(open(f))
    print(f.split('/')[-1], d['meta']['date'][11:16])
    for m in d['soak']['per_minute'][:2]:
        x=m.get('exact',{})
        print(' ',m['minute'], int(m['batches']), 'txn',round(m['batch_txn_p50_ms'],1), round(m['batch_txn_p99_ms'],1), 'cpu',{k:round(v) for k,v in m['cpu'].items()}, 'e2e',[round(x[k]) for k in ('p50_ms','p95_ms','p99_ms') if k in x], 'to', [round(v) for k,v in x.get('to_worker',{}).items() if 'ms' in k], 'in', [round(v) for k,v in x.get('in_worker',{}).items() if 'ms' in k])
