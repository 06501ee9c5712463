from trainaccel.launch.run import main

raise SystemExit(main())
