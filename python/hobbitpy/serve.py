"""``hobbitpy serve``: an OpenAI-compatible HTTP server whose model serves its experts from
the expert cache.

It is llama-cpp-python's own server (its ``[server]`` extra: FastAPI, uvicorn, the same
routes, streaming and chat formats as ``python -m llama_cpp.server``), with the model
loaded as a ``hobbitpy.Llama``, and two more routes: ``/health`` and Prometheus
``/metrics`` (the expert cache's counters and llama.cpp's token counts).
"""

from __future__ import annotations

from . import __version__
from .config import OffloadConfig
from .errors import HobbitError
from .llama import Llama


def _proxy_class():
    from llama_cpp.server.model import LlamaProxy

    class OffloadLlamaProxy(LlamaProxy):
        """llama-cpp-python's holder of the served model, loading a hobbitpy.Llama."""

        def __init__(self, models, offload: OffloadConfig):
            self.offload = offload  # read by the load in LlamaProxy.__init__
            super().__init__(models)

        def load_llama_from_model_settings(self, settings):
            # the ubatch only when asked for: left open, the planner narrows it when memory is short
            asked = {"n_ubatch": settings.n_ubatch} if "n_ubatch" in settings.model_fields_set else {}
            return Llama(settings.model, offload=self.offload, n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                         n_threads=settings.n_threads, n_gpu_layers=settings.n_gpu_layers,
                         n_threads_batch=settings.n_threads_batch, seed=settings.seed,
                         chat_format=settings.chat_format, flash_attn=settings.flash_attn,
                         last_n_tokens_size=settings.last_n_tokens_size, verbose=settings.verbose, **asked)

        @property
        def current(self) -> Llama | None:
            return self._current_model

    return OffloadLlamaProxy


class ExpertCacheCollector:
    """Prometheus metrics of the served model, read when scraped: the expert cache's
    counters (cumulative since load) and llama.cpp's evaluated tokens."""

    def __init__(self, proxy):
        self.proxy = proxy

    def collect(self):
        import llama_cpp
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        llm = self.proxy.current
        if llm is None:
            return
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        yield CounterMetricFamily("hobbitpy_prompt_tokens", "Prompt tokens evaluated (a reused prefix is not)",
                                  value=perf.n_p_eval)
        yield CounterMetricFamily("hobbitpy_generated_tokens", "Tokens decoded", value=perf.n_eval)
        yield GaugeMetricFamily("hobbitpy_decode_tokens_per_second", "Decoded tokens per second of decoding, since load",
                                value=perf.n_eval / (perf.t_eval_ms / 1000.0) if perf.t_eval_ms > 0 else 0.0)
        yield GaugeMetricFamily("hobbitpy_offloaded", "1 when the experts run through the expert cache",
                                value=1.0 if llm.offloaded else 0.0)
        stats = llm.offload_stats()
        if stats is None:
            return
        counters = {
            "expert_hits": ("expert_hits", "Selections of an expert found in the cache"),
            "expert_misses": ("expert_misses", "Selections of an expert that had to be loaded"),
            "expert_inplace": ("expert_inplace", "Missed experts computed in place on the mapped model"),
            "expert_skipped": ("n_skipped", "Selections skipped (missed, and scored below every precision)"),
            "read_bytes": ("bytes_read", "Bytes of experts read from disk"),
            "demand_read_bytes": ("demand_bytes_read", "Bytes read while a decode waited for them"),
            "background_read_bytes": ("background_bytes_read", "Bytes read in the background (prefetch, upgrades, warm-up)"),
            "prefetch_issued": ("prefetch_issued", "Experts prefetched"),
            "prefetch_used": ("prefetch_used", "Prefetched experts then selected"),
            "upgrades": ("upgrades", "Higher-precision copies loaded after a lower-precision hit"),
            "neuron_predicted_selections": ("neuron_selections", "Selections whose neurons CORM's mask predicted "
                                                                 "(--neurons; MoE layers after the first), or whose "
                                                                 "gate chose them (--neuron-layout; every MoE layer)"),
            "neuron_kept_selections": ("neuron_kept", "Those selections' kept shares of their neurons, summed "
                                                      "(divided by the above: the mean share kept)"),
            "neuron_read_requests": ("neuron_reads", "Reads of runs of neurons' rows (--neuron-layout)"),
        }
        for name, (key, doc) in counters.items():
            yield CounterMetricFamily(f"hobbitpy_{name}", doc, value=stats[key])
        yield CounterMetricFamily("hobbitpy_stall_seconds", "Time decoding waited for expert loads",
                                  value=stats["stall_us"] / 1e6)
        served = CounterMetricFamily("hobbitpy_served_selections", "Expert selections served, by precision level "
                                     "(0 = high)", labels=["level"])
        for level, n in enumerate(stats["served"]):
            served.add_metric([str(level)], n)
        yield served
        yield GaugeMetricFamily("hobbitpy_expert_cache_budget_bytes", "Bytes of the expert cache",
                                value=stats["budget_bytes"])


def create_app(model_path: str, offload: OffloadConfig, *, n_ctx: int, n_threads: int, n_gpu_layers: int = 0,
               alias: str | None = None, chat_format: str | None = None, api_key: str | None = None,
               verbose: bool = False):
    """The ASGI app: llama-cpp-python's routes (/v1/completions, /v1/chat/completions,
    /v1/models, ...) on a hobbitpy.Llama, plus /health and /metrics. Loads the model."""
    try:
        from fastapi import FastAPI
        from fastapi.middleware.cors import CORSMiddleware
        from fastapi.responses import JSONResponse
        from llama_cpp.server import app as server_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
        from prometheus_client import CollectorRegistry, make_asgi_app
        from starlette.middleware import Middleware
        from starlette_context.middleware import RawContextMiddleware
        from starlette_context.plugins import RequestIdPlugin
    except ImportError as e:
        raise HobbitError(f"serving needs llama-cpp-python's server extra and prometheus_client ({e}); "
                          "pip install 'hobbitpy[server]'") from None

    model_settings = ModelSettings(model=model_path, model_alias=alias, n_ctx=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers, chat_format=chat_format,
                                   verbose=verbose)
    server_settings = ServerSettings(api_key=api_key)
    proxy = _proxy_class()([model_settings], offload)

    # as llama_cpp.server.app.create_app builds it, with this proxy in place of one that
    # would load a stock llama_cpp.Llama first
    server_app.set_server_settings(server_settings)
    app = FastAPI(middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
                  title="hobbitpy", version=__version__)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
    app.include_router(server_app.router)
    server_app._llama_proxy = proxy  # the model every route of the router uses (set_llama_proxy takes settings)

    registry = CollectorRegistry()
    registry.register(ExpertCacheCollector(proxy))
    app.mount("/metrics", make_asgi_app(registry=registry))

    @app.get("/health")
    def health():
        llm = proxy.current
        return JSONResponse({"status": "ok" if llm is not None else "loading", "model": model_path,
                             "offloaded": bool(llm is not None and llm.offloaded)})

    return app


def serve(model_path: str, offload: OffloadConfig, *, host: str, port: int, n_ctx: int, n_threads: int,
          n_gpu_layers: int = 0, alias: str | None = None, chat_format: str | None = None, api_key: str | None = None,
          verbose: bool = False) -> None:
    """Load the model and serve it until interrupted."""
    import uvicorn

    app = create_app(model_path, offload, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, alias=alias,
                     chat_format=chat_format, api_key=api_key, verbose=verbose)
    uvicorn.run(app, host=host, port=port, log_level="info" if verbose else "warning")
