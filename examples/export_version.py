"""Export one stored version as a file that a serving process loads without vcdask.

usage: python examples/export_version.py --store STORE (--tag NAME | --version ID | --branch RUN_ID)
                                         --out FILE [--format export|state_dict] [--input-shape 1,8,8]

1. load the version with vcdask.load (the run that committed it supplies the model, so no model code is needed);
2. write FILE:
   - export (default): a torch.export program (``torch.export.load(FILE).module()`` runs it with torch alone;
     the batch dimension is dynamic). TorchScript is deprecated in recent torch releases, torch.export replaces it;
   - state_dict: the parameters for ``model.load_state_dict(torch.load(FILE, weights_only=True))``;
3. write FILE.json: version id, tag, run id, epoch, step and the file's sha256;
4. load FILE back and check that it gives the stored version's outputs on a random batch.

Exit codes: 0 written and checked; 4 no such store, version, tag or branch; 5 the written file does not
reproduce the stored version; 2 bad arguments; 1 anything else (with a traceback in the log).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

import vcdask
from vcdask.errors import StoreNotFoundError, VersionNotFoundError

logger = logging.getLogger("export_version")

EXPORTED, NOT_FOUND, MISMATCH = 0, 4, 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="store location: a directory or s3://bucket/prefix")
    ap.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, ...)")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--tag", help="a tag, e.g. nightly-3")
    which.add_argument("--version", help="a version id")
    which.add_argument("--branch", help="the newest version on this branch (a run's branch is its run id)")
    ap.add_argument("--out", required=True, type=Path, help="file to write (FILE.json gets the metadata)")
    ap.add_argument("--format", choices=["export", "state_dict"], default="export")
    ap.add_argument(
        "--input-shape",
        default="1,8,8",
        help="shape of one input sample, for the export and the check (default: %(default)s, the digits demo)",
    )
    args = ap.parse_args(argv)
    try:
        args.input_shape = tuple(int(n) for n in args.input_shape.split(","))
    except ValueError:
        ap.error(f"--input-shape must be comma-separated integers, got {args.input_shape!r}")
    return args


def write(model: torch.nn.Module, fmt: str, out: Path, example: torch.Tensor) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "state_dict":
        torch.save(model.state_dict(), out)
        return
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, out)


def reproduces(model: torch.nn.Module, fmt: str, out: Path, store, version: str, example: torch.Tensor) -> bool:
    """Whether the file on disk gives the stored version's outputs (state_dict: the same tensors, bit for bit)."""
    if fmt == "state_dict":
        fresh = vcdask.load(store, version=version)  # a second copy, overwritten by the file's tensors
        fresh.load_state_dict(torch.load(out, weights_only=True))
        stored = model.state_dict()
        return all(torch.equal(t, stored[name]) for name, t in fresh.state_dict().items())
    loaded = torch.export.load(out).module()
    with torch.no_grad():
        return torch.allclose(loaded(example), model(example), rtol=1e-5, atol=1e-6)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    try:
        store = vcdask.open_store(args.store, mode="r", **options)
        if args.branch:
            model = vcdask.load(store, branch=args.branch)
        else:
            model = vcdask.load(store, version=args.version, tag=args.tag)
    except (StoreNotFoundError, VersionNotFoundError) as e:
        logger.error("%s", e)
        return NOT_FOUND
    info = model.vcdask_version
    logger.info(
        "loaded version %s (run %s, epoch %s, step %s)",
        info["id"],
        info.get("run_id"),
        info.get("epoch"),
        info.get("step"),
    )

    example = torch.rand(4, *args.input_shape, generator=torch.Generator().manual_seed(0))
    write(model, args.format, args.out, example)
    if not reproduces(model, args.format, args.out, store, info["id"], example):
        logger.error("%s does not reproduce version %s; not keeping it", args.out, info["id"])
        args.out.unlink()
        return MISMATCH

    meta = {
        "version": info["id"],
        "tag": args.tag,
        "run_id": info.get("run_id"),
        "epoch": info.get("epoch"),
        "step": info.get("step"),
        "store": str(store.location),
        "format": args.format,
        "input_shape": list(args.input_shape),
        "sha256": hashlib.sha256(args.out.read_bytes()).hexdigest(),
    }
    sidecar = args.out.with_name(args.out.name + ".json")
    sidecar.write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("wrote %s (%s, %d bytes) and %s", args.out, args.format, args.out.stat().st_size, sidecar)
    return EXPORTED


if __name__ == "__main__":
    sys.exit(main())
