"""The discrete-event simulator: a swarm of real ``NodeCore`` objects in virtual time.

``peerinfer sim`` (or ``python -m peerinfer.sim``) runs it from the command line; from Python::

    from peerinfer.sim import SimConfig, simulate

    sim, summary = simulate(SimConfig(nodes=16, requests=5000, policy="cost", delay_ms="5"))
    print(summary["ttft_mean_s"], summary["hit_ratio"])

See ``peerinfer.sim.simulator`` for how effects are executed and what is simplified, and
docs/evaluation.md for the figures it produced.
"""

from peerinfer.sim.cli import add_sim_arguments, run_sim_command
from peerinfer.sim.config import SimConfig, load_costs
from peerinfer.sim.network import DelayModel
from peerinfer.sim.run import simulate
from peerinfer.sim.simulator import SimRequest, Simulation, SimulationError

__all__ = [
    "DelayModel",
    "SimConfig",
    "SimRequest",
    "Simulation",
    "SimulationError",
    "add_sim_arguments",
    "load_costs",
    "run_sim_command",
    "simulate",
]
