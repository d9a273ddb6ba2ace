"""The batch server side of ladle: dataset access, the schedule, and the CLI.

Layers point one way: ``cli`` -> ``dataset`` / ``schedule``; the schedule
package imports no network, store or web code.
"""
