import asyncio, ray
from ray import serve
ray.init(address="auto", log_to_driver=False)
async def main():
    e = serve.get_deployment_handle("Engine", app_name="lifecycle")
    g = serve.get_deployment_handle("Egress", app_name="lifecycle")
    s = await e.stats.remote()
    try:
        gs = await g.stats.remote()
    except Exception as exc:
        gs = repr(exc)[:100]
    print({k: s.get(k) for k in ("admission_calls", "admission_requests", "admitted_streams", "channel_batches", "channel_items")}, gs)
asyncio.run(main())
