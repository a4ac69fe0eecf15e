"""The dispatcher: queues jobs from the front ends, routes them to workers, supervises."""
