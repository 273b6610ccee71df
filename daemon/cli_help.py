"""The examples at the end of each subcommand's ``--help``: the commands an operator types most, as they type
them (docs/operations.md has the story around them)."""

from __future__ import annotations

_EXAMPLES = {
    "agent": """
  tfelastic agent --config /etc/tfelastic/mnist.toml     # what tfelastic@mnist.service runs
""",
    "run": """
  # 2 to 4 nodes; the node that owns 10.0.0.1 hosts the coordinator
  tfelastic run --nodes 2:4 --rendezvous 10.0.0.1:29400 --token-file /etc/tfelastic/token \\
      --backup-dir /shared/ckpt/mnist -- python train.py --epochs 20
  # the same job on etcd: any node may lead, and the coordinator fails over
  tfelastic run --nodes 2:4 --rendezvous etcd://etcd-1:2379,etcd-2:2379,etcd-3:2379 --job mnist \\
      --token-file /etc/tfelastic/token --backup-dir /shared/ckpt/mnist -- python train.py
""",
    "coordinator": """
  tfelastic coordinator --config /etc/tfelastic/mnist.toml     # serves the file's rendezvous.endpoint
  tfelastic coordinator --listen 0.0.0.0:29400 --token-file /etc/tfelastic/token --job mnist
  TFELASTIC_LISTEN=head-01:29400 tfelastic coordinator --rendezvous etcd://etcd-1:2379 --job mnist
""",
    "status": """
  tfelastic status --config /etc/tfelastic/mnist.toml           # rendezvous, job and token from the job file
  tfelastic status --rendezvous 10.0.0.1:29400 --token-file /etc/tfelastic/token --watch
  tfelastic status --config /etc/tfelastic/mnist.toml --json | jq '.nodes[] | {node_id, step}'
""",
    "drain": """
  tfelastic drain gpu-03 --config /etc/tfelastic/mnist.toml --reason "PSU swap"
""",
    "readmit": """
  tfelastic readmit gpu-03 --config /etc/tfelastic/mnist.toml    # after the repair
""",
    "report": """
  tfelastic report --config /etc/tfelastic/mnist.toml
  tfelastic report --rendezvous etcd://etcd-1:2379 --job mnist --json     # also after the job ended
""",
    "restart": """
  tfelastic restart --config /etc/tfelastic/mnist.toml --reason "new data shard"
""",
    "demo": """
  tfelastic demo                   # 2 local agents, one worker killed, the job resumes
  tfelastic demo --nodes 3 --faults 2 --json
""",
    "install": """
  sudo /opt/tfelastic/bin/tfelastic install mnist --uid 970     # then edit /etc/tfelastic/mnist.toml
  tfelastic install mnist --destdir pkgroot                       # stage the files (packaging)
""",
    "completion": """
  source <(tfelastic completion bash)                              # this shell
  tfelastic completion bash > /etc/bash_completion.d/tfelastic     # every shell
  tfelastic completion zsh > "${fpath[1]}/_tfelastic"
""",
}

ENVIRONMENT_NOTE = """\
Settings also come from TFELASTIC_<OPTION> variables and the job file (--config, $TFELASTIC_CONFIG); flags win.
Exit codes: 0 done, 1 failed, 2 a malformed command line, 78 a bad configuration (docs/configuration.md)."""


def epilog(command: str) -> str:
    return f"examples:{_EXAMPLES[command].rstrip()}\n\n{ENVIRONMENT_NOTE}"
