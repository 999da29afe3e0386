"""The scheduler side of vcdask: a :class:`~vcdask.engine.plugin.VcdaskPlugin` on the Dask scheduler hosts
runs; each :class:`~vcdask.engine.run.Run` is a loop wired from small parts (see ``docs/architecture.md``)."""
