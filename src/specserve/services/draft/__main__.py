"""`python -m specserve.services.draft`: load the drafter, warm up, serve until SIGTERM (drained)."""

from __future__ import annotations

import asyncio
import logging

from specserve.config import DraftSettings
from specserve.services.draft.server import DraftServicer
from specserve.serving.grpc_server import GrpcServer, run_main
from specserve.serving.telemetry import (
    TracingServerInterceptor,
    publish_ports,
    setup_tracing,
    shutdown_tracing,
)
from specserve.serving.tls import load as load_tls
from specserve.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specserve.draft")

NGRAM_VOCAB = 1 << 31  # n-gram drafting needs no vocabulary; ids are only range-checked


def load_drafter(settings: DraftSettings):
    from specserve.drafters import HFDrafter, NgramDrafter

    if settings.model == "ngram":
        return NgramDrafter(NGRAM_VOCAB, settings.ngram_min, settings.ngram_max, name=settings.pool)
    if settings.model == "eagle":  # an EAGLE head fed the target's features over the Link (ADR 0020)
        return load_eagle_drafter(settings)

    import torch

    from specserve.models.loading import load_model

    # on the model thread (main): OpenMP takes the count in the thread that sets it (threads.py)
    torch.set_num_threads(settings.torch_threads)
    model = load_model(settings.model)
    if settings.lora:  # an adapter's own drafter: its draft-side LoRA merged in (ADR 0029)
        from specserve.models.lora import merge_adapter

        merge_adapter(model, settings.lora, settings.pool)
        log.info("draft pool %s: adapter %s merged into %s", settings.pool, settings.lora, settings.model)
    return HFDrafter(model, name=settings.pool, q_mass=settings.q_mass, q_max_entries=settings.q_max_entries)


def load_eagle_drafter(settings: DraftSettings):
    """The head (`eagle_head`) and what it borrows from its target (`eagle_target`: the token
    embedding, final norm and LM head, read alone from the target's weights)."""
    from pathlib import Path

    import torch

    from specserve.drafters.eagle import EagleDrafter, TargetParts, load_head

    if not settings.eagle_head or not settings.eagle_target:
        raise ValueError("an eagle draft replica needs eagle_head (the head's directory) and eagle_target (its "
                         "target's model directory)")
    torch.set_num_threads(settings.torch_threads)
    head = load_head(Path(settings.eagle_head))
    return EagleDrafter(head, TargetParts.from_weights(settings.eagle_target, head.cfg.feature_layers))


def _tokenizer(settings: DraftSettings):
    """The tokenizer that masks the replica's drafts under a constraint (ADR 0017): the
    `tokenizer` setting's directory, else the model's own; none for an n-gram replica without
    one (it drafts free, and the target's masks keep the output exact)."""
    from pathlib import Path

    from specserve.model_info import ModelInfo

    directory = settings.tokenizer or ("" if settings.model == "ngram" else
                                       settings.eagle_target if settings.model == "eagle" else settings.model)
    return ModelInfo(directory) if directory and (Path(directory) / "tokenizer.json").exists() else None


async def warm_up(servicer: DraftServicer) -> None:
    """One block through the whole path (scheduler, engine), then forget the session."""
    from specserve.v1 import common_pb2

    req = draft_pb2.ProposeRequest(session_id="\0warm-up", prefix=common_pb2.Prefix(tokens=[0, 1, 2, 1]), k=2)
    await servicer.propose(req)
    servicer.sessions.release(req.session_id)


async def main(settings: DraftSettings) -> None:
    setup_tracing(f"specserve-draft-{settings.pool}")
    from specserve.worker import threads
    from specserve.worker.model_step import Batching

    model_thread = threads.ModelThread("draft")  # loads the model and runs every batch (threads.py)

    def build() -> DraftServicer:
        return DraftServicer(load_drafter(settings), settings.max_sessions,
                             simulated_token_ms=settings.simulated_token_ms, batching=Batching.from_settings(settings),
                             max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
                             max_batched_tokens=settings.max_batched_tokens,
                             evict_idle_s=settings.kv_evict_idle_s, tokenizer=_tokenizer(settings),
                             model_thread=model_thread, max_queue=settings.max_queue)

    servicer = await asyncio.wrap_future(model_thread.submit(build))
    server = GrpcServer(
        [draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name], settings.host, settings.port,
        settings.grace_s, lambda s: draft_pb2_grpc.add_DraftServicer_to_server(servicer, s),
        interceptors=[TracingServerInterceptor()],
        credentials=tls.server(require_client_cert=True) if (tls := load_tls(settings.tls_dir)) else None)
    server.on_drain.append(servicer.end_links)
    await server.start()
    publish_ports(server.port, settings.port_file, servicer.metrics.registry, settings.metrics_port,
                  settings.metrics_port_file, settings.host)
    await warm_up(servicer)
    await server.set_serving()
    log.info("draft pool %s (%s) serving on %s:%d", settings.pool, settings.model, settings.host, server.port)
    await server.wait_for_termination()
    shutdown_tracing()
    log.info("draft worker drained and stopped")


if __name__ == "__main__":
    run_main(main, DraftSettings())
