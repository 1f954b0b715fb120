"""A vLLM worker extension for the engine tests' servers (`--worker-extension-cls`), called through `/collective_rpc`.

vLLM's CPU build repacks the LM head from the embedding at load time; reloading weights from a checkpoint updates the
embedding but leaves a tied LM head packed from the old one. `reload_weights_tied` reloads and repacks the tied head
as the package's colocate sync does (`vllm_batched._refresh_tied_lm_head`), so a weight push by reload leaves the
server with exactly the pushed weights, as TRL's NCCL push does on GPU.
"""

from __future__ import annotations


class ReloadWorkerExtension:
    def reload_weights_tied(self, weights_path: str) -> None:
        from retool_trl.rollout.engines.vllm_batched import _refresh_tied_lm_head

        self.model_runner.reload_weights(weights_path=weights_path)
        _refresh_tied_lm_head(self.model_runner.get_model())
