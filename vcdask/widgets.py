"""Progress display.  The console form is a tqdm bar over epochs with the latest metrics."""

from __future__ import annotations

__all__ = ["console_progress"]


class _NoProgress:
    def update(self, status: dict) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleProgress:
    """A tqdm bar: one unit per epoch; the postfix shows merges in the epoch and the last metrics."""

    def __init__(self, status: dict):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=status["max_epochs"], unit="epoch", desc=status["run_id"], leave=True)
        self.done = 0

    def update(self, status: dict) -> None:
        done = status["epochs_done"]
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done
        post = {"merged": f"{status['merged_in_epoch']}/{status['n_shards']}", "v": status["step"]}
        for k, v in (status.get("last_epoch") or {}).items():
            if k in ("epoch", "version", "wall_time") or k.endswith(("_mean", "_min", "_max")):
                continue
            post[k] = f"{v:.4f}"
        self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        self.bar.close()


def console_progress(status: dict, enabled: bool = True):
    """A progress display for the run whose first status is ``status``, or a no-op one."""
    return ConsoleProgress(status) if enabled else _NoProgress()
