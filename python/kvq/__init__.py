"""kvq: LLM inference with a compressed KV cache, from Python.

- ``kvq.Model(path)``: a GGUF model; ``generate``, ``stream``, ``tokenize``, ``detokenize``,
  ``perplexity`` (the figures of the CLI's ``--json`` output).
- ``kvq.KVCache(n_layer, n_kv_head, head_dim, n_ctx, type_k=..., type_v=..., ...)``: the cache
  alone, over numpy float32 arrays or torch CPU tensors: ``append``, ``attend``, ``truncate``,
  ``bytes_used``, ``attend_batch``.
- ``kvq.hf`` (import it; needs torch and transformers): ``KVQCache``, a transformers ``Cache`` on
  kvq's compressed cache, and ``attn_implementation="kvq"``, which attends on it.

Cache options are keyword arguments spelled as the CLI's KV flags: ``type_k="q4"`` (-ctk),
``type_v`` (-ctv), ``rotation`` (--kv-rot), ``group_size`` (--kv-group), ``sink`` (--kv-sink),
``recent`` (--kv-exact-recent), ``kivi_group``, ``kivi_residual``, ``channel_scale``,
``k_channel_scale``, ``channel_calib`` (--kv-channel-calib), ``kv_seed``, ``certify``, ``certify_tol``,
``certify_budget`` (--kv-cert-budget), ``host_dir``, ``certify_measure``, ``certify_adapt``. kvq's errors raise ``ValueError`` (bad input, unsupported) or ``OSError``
(files), with kvq's message.
"""
import codecs
import queue
import threading

from ._kvq import KVCache, Model, __version__, kv_type_names

__all__ = ["Model", "KVCache", "kv_type_names", "__version__"]


class _StopStream(Exception):
    pass


def _stream(self, prompt, max_tokens=128, temperature=0.0, **kwargs):
    """Yields the generated text piece by piece, as ``generate`` (same arguments) produces it.

    Generation runs in a background thread (the engine releases the GIL); the pieces are decoded
    as UTF-8 incrementally, so a character split across tokens is yielded whole. Closing the
    iterator early stops the generation at the next token. Errors raise here as from generate.
    """
    pieces = queue.Queue(maxsize=64)
    closed = threading.Event()
    done = object()

    def on_token(piece):
        if closed.is_set():
            raise _StopStream()
        pieces.put(piece)

    def run():
        try:
            self.generate(prompt, max_tokens, temperature, on_token=on_token, **kwargs)
            pieces.put(done)
        except _StopStream:
            pieces.put(done)
        except BaseException as e:  # handed to the consumer
            pieces.put(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        while True:
            item = pieces.get()
            if item is done:
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield tail
                return
            if isinstance(item, BaseException):
                raise item
            text = decoder.decode(item)
            if text:
                yield text
    finally:
        closed.set()
        while worker.is_alive():  # unblock a full queue, then let the worker finish
            try:
                pieces.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


Model.stream = _stream
