"""Everything that speaks Redis, worker side and relay side, one job per module.

Each module imports only the ones above it in this list (and, for the relay's manager, the
relay's lower floors: ``kernel_ext.relay._log``, ``._send``, ``.workers``; the relay's
namespace never imports this package, the app picks the manager):

==================  ======================================================================
``ping``            whether a Redis answers, asked once before a process depends on it
``publish_result``  :class:`~kernel_ext.redis.publish_result.PublishResult`: what each
                    publish reached (Redis's receiver count), a task's publishes as one
                    pipeline
``routing``         room routing: each message's channel, the rooms' logs, the marker of
                    routing web processes (:class:`~kernel_ext.redis.routing.RoutedPublish`)
``stops``           a browser's stop on Redis: a write-only worker's stop channel, and stops
                    forwarded among web processes for their workers (a subscription each)
``emitter``         :class:`~kernel_ext.redis.emitter.RedisEmitter`, the worker-side sender
                    (also importable as ``kernel_ext.emit.RedisEmitter``)
``republish``       the relay manager's terminals published again after an outage
``worker_watch``    the relay manager's watch of write-only workers: their streams ended
                    when they fall silent
``subscription``    the relay manager's own subscription (kept up, its state) and the room
                    channels it subscribes to
``room_log``        a room's log read into the relay's catch-up memory at a join and after
                    an outage
``manager``         :class:`~kernel_ext.redis.manager.RelayRedisManager`, the web process's
                    client manager made of the four parts above (also importable as
                    ``kernel_ext.relay.RelayRedisManager``)
==================  ======================================================================

The package is named ``redis`` inside ``kernel_ext``; its modules import the ``redis``
library by its absolute name, which this package does not shadow.
"""
